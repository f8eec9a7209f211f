"""Behaviour of the recipe walker, the memory estimates and the provenance writer that no test pinned
(each test here fails on a plausible one-line change to the code it names)."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from eaglenest import memfit, runconfig
from eaglenest.config import MAX_YAML_BYTES, MAX_YAML_NODES, InvalidYAML, build, load_yaml, parse_yaml, to_dict
from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.paths import ensure_writable, install_dir
from eaglenest.provenance import REDACTED, redact, write_json_atomic, write_provenance
from eaglenest.recipe import load_recipe


@pytest.mark.parametrize("typed,value", [("1e-4", 1e-4), ("5E+2", 500.0), ("1e3", 1000.0), ("-2.5e-1", -0.25)])
def test_a_rate_written_without_a_dot_is_a_float_in_a_file_and_an_override(root, tmp_path, typed, value):
    """YAML 1.1 reads ``1e-4`` as text; a float key takes it as the number written (README: ``lr=1e-4``)."""
    p = tmp_path / "r.yaml"
    p.write_text(f"train:\n  lr: {typed}\n")
    if value > 0:
        assert load_recipe(str(p)).train.lr == value
        assert load_recipe(str(root / "recipes" / "toy.yaml"), [f"train.lr={typed}"]).train.lr == value
    else:  # a negative rate is refused by its own rule, not as text
        with pytest.raises(ConfigError, match=r"train\.lr: must be > 0"):
            load_recipe(str(p))


def test_a_tuple_key_given_as_a_yaml_list_is_a_tuple(root):
    """``evaluate.context_buckets`` is ``tuple[int, ...]``: a list from YAML must become a tuple, or the
    frozen section can no longer be hashed and never equals the same buckets by default."""
    cfg = build(EvaluateConfig, {"context_buckets": list(EvaluateConfig().context_buckets)}, where="evaluate")
    assert type(cfg.context_buckets) is tuple and cfg == EvaluateConfig()
    hash(cfg.context_buckets)
    r = load_recipe(str(root / "recipes" / "toy.yaml"), ["evaluate.concurrency=[1, 2]"])
    assert r.evaluate.concurrency == (1, 2)


def test_a_file_of_exactly_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path):
    head = "run:\n  seed: 3\n"
    p = tmp_path / "r.yaml"
    p.write_text(head + "#" * (MAX_YAML_BYTES - len(head) - 1) + "\n")
    assert p.stat().st_size == MAX_YAML_BYTES
    assert load_yaml(p) == {"run": {"seed": 3}}
    p.write_text(head + "#" * (MAX_YAML_BYTES - len(head)) + "\n")
    with pytest.raises(ConfigError, match="larger than 256 KiB"):
        load_yaml(p)


def test_the_value_count_limit_is_exact():
    """A flow list of n items is n + 1 values (the list itself): MAX_YAML_NODES values are read."""
    assert parse_yaml("[" + ", ".join(["0"] * (MAX_YAML_NODES - 1)) + "]") == [0] * (MAX_YAML_NODES - 1)
    with pytest.raises(InvalidYAML, match=f"more than {MAX_YAML_NODES} values"):
        parse_yaml("[" + ", ".join(["0"] * MAX_YAML_NODES) + "]")


def test_the_text_typed_is_used_only_while_it_is_still_the_value(root):
    """``run_name=1`` is the text "1"; a later override of the whole section replaces that value, and the
    number it gives a text key is refused as in a file, never turned back into the earlier "1"."""
    toy = str(root / "recipes" / "toy.yaml")
    assert load_recipe(toy, ["train.track.run_name=1"]).train.track.run_name == "1"
    assert load_recipe(toy, ["train.track.run_name=1", "train.track={run_name: abc}"]).train.track.run_name == "abc"
    with pytest.raises(ConfigError, match=r"^train\.track\.run_name: expected str, got 2"):
        load_recipe(toy, ["train.track.run_name=1", "train.track={run_name: 2}"])


@dataclasses.dataclass(frozen=True)
class _Leaf:
    n: int = 1


def test_to_dict_is_plain_data_through_tuples_and_lists():
    assert to_dict({"a": (_Leaf(2), [_Leaf()])}) == {"a": [{"n": 2}, [{"n": 1}]]}


@pytest.mark.parametrize("recipe", ["toy.yaml", "long.yaml"])
def test_the_recipe_a_provenance_file_records_runs_the_same_recipe_again(root, tmp_path, recipe):
    """provenance.json's ``config`` is the resolved recipe: given back as a recipe (JSON is YAML) it
    resolves to the same sections, text that looks like a number and object-store options included."""
    r = load_recipe(str(root / "recipes" / recipe), ["train.track.run_name=0601", "run.storage_options.region=1",
                                                    "evaluate.concurrency=[2, 3]", "train.lr=1e-4"])
    path = write_provenance(tmp_path / "out", config=r.to_dict(), argv=["train", "run"])
    again = tmp_path / "again.yaml"
    again.write_text(json.dumps(json.loads(path.read_text())["config"]))
    assert load_recipe(str(again)).sections == r.sections


def test_the_seed_range_ends_below_two_to_the_63(root):
    toy = str(root / "recipes" / "toy.yaml")
    assert load_recipe(toy, [f"run.seed={2**63 - 1}"]).run.seed == 2**63 - 1
    with pytest.raises(ConfigError, match=r"^run\.seed: must be in \[0, 2\*\*63\)"):
        load_recipe(toy, [f"run.seed={2**63}"])


@pytest.mark.parametrize("value", ["hunter2${AWS_REGION}", "${AWS_SECRET}-literal", "${A}${B}"])
def test_a_credential_option_is_one_whole_env_reference_or_refused_unechoed(root, value):
    """A literal secret beside a ``${VAR}`` reference would land in provenance.json as typed."""
    with pytest.raises(ConfigError) as err:
        load_recipe(str(root / "recipes" / "toy.yaml"), [f"run.storage_options.aws_secret_access_key={value}"])
    assert "credentials are not written in a recipe" in str(err.value) and value not in str(err.value)
    ok = load_recipe(str(root / "recipes" / "toy.yaml"), ["run.storage_options.aws_secret_access_key=${MY_KEY}"])
    assert ok.run.storage_options == {"aws_secret_access_key": "${MY_KEY}"}


def test_storage_options_come_from_the_longest_registered_store_a_path_is_under(monkeypatch):
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    monkeypatch.setenv("QA8_REGION", "eu-west-3")
    runconfig.register_storage_options("s3://bucket/", {"region": "us-east-1"})
    runconfig.register_storage_options("s3://bucket/deep", {"region": "${QA8_REGION}"})
    assert runconfig.storage_options_for("s3://bucket/deep/features.lance") == {"region": "eu-west-3"}
    assert runconfig.storage_options_for("s3://bucket/deep") == {"region": "eu-west-3"}
    assert runconfig.storage_options_for("s3://bucket/deeper/x.lance") == {"region": "us-east-1"}  # not under deep
    assert runconfig.storage_options_for("s3://bucket2/x.lance") == {}  # another bucket


def test_a_secret_holding_another_is_redacted_whole(monkeypatch):
    """Two secret-named variables, one value inside the other: the longer one is replaced first, or the
    rest of it (past the shorter one) would be written as typed."""
    monkeypatch.setenv("QA8_SHORT_TOKEN", "abcd1234")
    monkeypatch.setenv("QA8_LONG_SECRET", "abcd1234-the-rest-of-it")
    out = redact({"argv": ["x=abcd1234-the-rest-of-it", "y=abcd1234"]})
    assert out == {"argv": [f"x={REDACTED}", f"y={REDACTED}"]}


def test_a_secret_of_eight_characters_is_redacted(monkeypatch):
    monkeypatch.setenv("QA8_DB_PASSWORD", "hunter42")
    assert redact(["--url", "db://x/hunter42/y"]) == ["--url", f"db://x/{REDACTED}/y"]


def test_a_nan_inside_a_tuple_is_written_as_null(tmp_path):
    """Stats hold tuples too (a per-position pair): a NaN there made json.dumps(allow_nan=False) raise."""
    path = tmp_path / "stats.json"
    write_json_atomic(path, {"pair": (math.nan, 1.5), "nested": [{"x": (math.inf,)}]})
    assert json.loads(path.read_text()) == {"pair": [None, 1.5], "nested": [{"x": [None]}]}


#: A small Llama config whose sizes make every estimate easy to work out by hand.
_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, "dtype": "bfloat16"}


@pytest.mark.parametrize("tokens", [100, 8192, 20000])
def test_engine_parts_from_first_principles(tokens):
    """K and V per layer, per KV head, per head dim, in the engine's dtype; a prefill chunk of at most
    the batched-token budget; one hidden-state slot per captured layer and token."""
    dims = memfit.target_dims(_SMALL)
    parts = memfit.engine_parts(dims, tokens=tokens, weights=123, capture_layers=4, batched_tokens=8192)
    b = 2  # bfloat16
    assert parts["weights"] == 123
    assert parts["kv_cache"] == tokens * 2 * 2 * 2 * 16 * b  # K and V x layers x kv heads x head_dim
    assert parts["prefill_activations"] == min(tokens, 8192) * (4 * 64 + 2 * 128) * b
    assert parts["hidden_state_slots"] == tokens * 4 * 64 * b
    assert "hidden_state_slots" not in memfit.engine_parts(dims, tokens=tokens, weights=0)


def test_target_dims_fill_what_transformers_fills():
    """head_dim = hidden / heads, KV heads = heads, intermediate = 4 x hidden where missing, null or 0."""
    bare = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    for cfg in (bare, {**bare, "head_dim": None, "num_key_value_heads": 0, "intermediate_size": None}):
        dims = memfit.target_dims(cfg)
        assert (dims["head_dim"], dims["kv_heads"], dims["intermediate"]) == (16, 4, 256)
    assert memfit.target_dims({**_SMALL, "torch_dtype": "torch.float32", "dtype": None})["dtype_bytes"] == 4
    assert memfit.target_dims(_SMALL, engine_dtype="float32")["dtype_bytes"] == 4


def test_capture_rows_are_held_three_times_at_least_as_the_raw_states():
    dims = memfit.target_dims(_SMALL)
    est = memfit.capture_estimate(dims, tokens=50, weights=0, capture_layers=4, stored_bytes_per_token=0, key="k")
    assert est.parts["captured_rows"] == 3 * 50 * 4 * 64 * 2
    bigger = memfit.capture_estimate(dims, tokens=50, weights=0, capture_layers=4, stored_bytes_per_token=10_000,
                                     key="k")
    assert bigger.parts["captured_rows"] == 3 * 50 * 10_000


def test_train_estimate_from_first_principles():
    est = memfit.train_estimate(pack_tokens=16, rows=1, hidden=8, num_aux=3, heads=2, head_dim=4, intermediate=12,
                                draft_vocab=10, target_vocab=20, ttt_steps=3, attn_chunk_tokens=64,
                                target_chunk_tokens=8)
    f, T = 4, 16
    assert est.parts["features"] == T * (3 + 1) * 8 * f
    assert est.parts["target_distribution"] == T * 10 * f + 8 * 20 * f  # the target vocab one chunk at a time
    assert est.parts["draft_logits"] == 3 * T * 10 * f and "draft_log_probs" not in est.parts  # chunked loss
    assert est.parts["attention_scores"] == 3 * 2 * T * T * f
    # TTT step k (0-based) attends to the row's T keys and k diagonal ones: 0 + 1 + 2 more keys in all
    assert est.parts["attention_probs"] == 2 * T * (3 * T + 0 + 1 + 2) * f


def test_available_memory_is_in_bytes():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 64 << 20 <= memfit.available_bytes() <= total  # MemAvailable is in KiB: x 1024


def test_a_check_before_the_input_is_accepted_leaves_no_folder_behind(tmp_path):
    ensure_writable(tmp_path / "a" / "b c" / "d", "run.workdir", keep=False)
    assert not (tmp_path / "a").exists()
    ensure_writable(tmp_path / "a" / "b c" / "d", "run.workdir")
    assert (tmp_path / "a" / "b c" / "d").is_dir() and not any((tmp_path / "a" / "b c" / "d").iterdir())


def test_an_install_that_fails_puts_the_earlier_output_back(tmp_path):
    out = tmp_path / "draft"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(FileNotFoundError, match="gone before the rename"):  # the second rename's, after the move
        install_dir(tmp_path / "gone before the rename", out)
    assert (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_a_literal_storage_credential_is_redacted_by_the_backstop_and_a_reference_kept():
    """The recipe refuses literal credentials; a record written by other code (a checkpoint's recipe, an
    export's) still never holds one."""
    opts = {"aws_secret_access_key": "not-a-reference", "aws_region": "eu-west-3", "aws_session_token": "${TOK}"}
    out = redact({"run": {"storage_options": opts}, "other": {"aws_secret_access_key": "kept: not a store option"}})
    assert out["run"]["storage_options"] == {"aws_secret_access_key": REDACTED, "aws_region": "eu-west-3",
                                             "aws_session_token": "${TOK}"}
    assert out["other"] == {"aws_secret_access_key": "kept: not a store option"}
