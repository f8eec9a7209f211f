"""Behaviour of the recipe surface, the memory estimates, the paths and the provenance writer that no test
pinned (QA pass 11's mutation audit: each test fails on a plausible one-line change to the code it names)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pwd
import re
import sys
from pathlib import Path

import pytest

from eaglenest import material, memfit, runconfig
from eaglenest.config import MAX_YAML_DEPTH, InvalidYAML, apply_overrides, build, parse_yaml
from eaglenest.errors import ConfigError, StoreError
from eaglenest.paths import check_output_dir, orphans, pid_prefix, shown_path, user_path
from eaglenest.precheck import check_max_model_len
from eaglenest.provenance import REDACTED, command_line, redact
from eaglenest.recipe import load_recipe


@pytest.fixture
def toy(root) -> str:
    return str(root / "recipes" / "toy.yaml")


@pytest.mark.parametrize("override,key,value", [
    ("train.track.run_name=a=b", "run_name", "a=b"),
    ("train.track.run_name==x", "run_name", "=x"),
    ("train.track.run_name=lr=1e-4,bs=2", "run_name", "lr=1e-4,bs=2"),
])
def test_an_override_is_split_at_its_first_equals_sign(toy, override, key, value):
    """``section.key=value``: the key has no '=', the value may hold any (a run name, a URL's query)."""
    assert getattr(load_recipe(toy, [override]).train.track, key) == value


def test_overrides_leave_the_mapping_they_are_applied_to_as_it_was():
    """The recipe's mapping is copied, not changed in place: a caller applying two sets of overrides to one
    file's mapping (a sweep) gets each set alone."""
    data = {"train": {"lr": 0.1, "stream": {"depth": 2}}, "run": {}}
    before = copy.deepcopy(data)
    first = apply_overrides(data, ["train.lr=0.5", "train.stream.depth=4", "run.seed=3", "serve.port=1"])
    assert data == before
    assert first == {"train": {"lr": 0.5, "stream": {"depth": 4}}, "run": {"seed": 3}, "serve": {"port": 1}}
    assert apply_overrides(data, ["train.num_epochs=2"]) == {**before, "train": {**before["train"], "num_epochs": 2}}


@pytest.mark.parametrize("typed", ["2024-01-01", "2024-01-01 10:00:00", "2001-12-14t21:59:43.10-05:00"])
def test_a_date_typed_as_an_override_is_the_text_typed(toy, typed):
    """YAML 1.1 reads these as dates, which no key takes: an override keeps the text (a run named by its day)."""
    assert load_recipe(toy, [f"train.track.run_name={typed}"]).train.track.run_name == typed


def test_the_nesting_bound_is_exact():
    """MAX_YAML_DEPTH levels are read; one more is refused before the recursive composer goes deeper."""
    assert parse_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH) is not None
    with pytest.raises(InvalidYAML, match=rf"more than {MAX_YAML_DEPTH} levels"):
        parse_yaml("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1))


def test_a_tilde_user_path_is_that_users_home(toy, monkeypatch):
    """``~name/...`` is name's home (the password database), as a shell expands it; not a folder named '~name'."""
    monkeypatch.setenv("HOME", "/nonexistent-qa11")  # ~ alone follows HOME; ~name never does
    me = pwd.getpwuid(os.getuid())
    recipe = load_recipe(toy, [f"run.workdir=~{me.pw_name}/runs/x", "run.store=~/s"])
    assert recipe.run.workdir == str(Path(me.pw_dir) / "runs" / "x")
    assert recipe.run.store_uri == "/nonexistent-qa11/s"


def test_a_boolean_storage_option_is_lowercase_text(toy):
    """Lance's object store parses ``allow_http`` as 'true' / 'false'; Python's 'True' is no boolean to it."""
    on = load_recipe(toy, ["run.storage_options={allow_http: true, aws_region: eu-west-1, retries: 3}"])
    assert on.run.storage_options == {"allow_http": "true", "aws_region": "eu-west-1", "retries": "3"}
    assert load_recipe(toy, ["run.storage_options.allow_http=false"]).run.storage_options == {"allow_http": "false"}


@pytest.mark.parametrize("store", ["s3://bucket/./features", "s3://bucket/../x", "gs://b/p/./q", "az://b/p/../q"])
def test_a_dot_segment_anywhere_under_the_bucket_is_refused(toy, store):
    with pytest.raises(ConfigError, match=r"^run\.store: .* '\.' or '\.\.' path segment"):
        load_recipe(toy, [f"run.store={store}"])


def test_a_store_is_not_under_another_whose_name_it_only_starts_with(monkeypatch):
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    runconfig.register_storage_options("s3://bucket/run", {"region": "a"})
    assert runconfig.storage_options_for("s3://bucket/run/store/features.lance") == {"region": "a"}
    assert runconfig.storage_options_for("s3://bucket/run2/features.lance") == {}
    assert runconfig.storage_options_for("s3://bucket/runs") == {}


def test_an_upper_case_scheme_is_an_object_store_and_registers_its_options(toy, monkeypatch):
    """URI schemes are case-insensitive (RFC 3986): ``S3://`` is S3, its options go with it."""
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    recipe = load_recipe(toy, ["run.store=S3://bucket/p", "run.storage_options.aws_region=eu-west-1"])
    recipe.run.register_storage()
    assert runconfig.storage_options_for("S3://bucket/p/features.lance") == {"aws_region": "eu-west-1"}
    with pytest.raises(ConfigError, match=r"^run\.store: .*names no bucket"):
        load_recipe(toy, ["run.store=GS:///p"])


@pytest.mark.parametrize("interpreter", [["/usr/bin/python3"], ["/usr/bin/python3", "-u", "-X", "dev"]])
def test_a_module_run_is_recorded_as_python_dash_m_and_its_arguments(monkeypatch, interpreter):
    args = ["build", "--recipe", "r.yaml", "train.lr=1e-4"]
    monkeypatch.setattr(sys, "argv", ["/abs/site-packages/eaglenest/ingest/cli.py", *args])
    monkeypatch.setattr(sys, "orig_argv", [*interpreter, "-m", "eaglenest.ingest.cli", *args])
    assert command_line() == ["python", "-m", "eaglenest.ingest.cli", *args]
    monkeypatch.setattr(sys, "orig_argv", [*interpreter, "/abs/site-packages/eaglenest/ingest/cli.py", *args])
    assert command_line() == ["/abs/site-packages/eaglenest/ingest/cli.py", *args]


def test_a_program_under_the_working_directory_is_recorded_relative_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert command_line([str(tmp_path / ".venv" / "bin" / "ingest"), "build"]) == [".venv/bin/ingest", "build"]
    assert command_line(["/elsewhere/bin/ingest", "build"]) == ["/elsewhere/bin/ingest", "build"]


_SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "vocab_size": 256, "dtype": "float32"}


def _weights(folder: Path, sizes: dict[str, int], index: dict | None = None) -> Path:
    folder.mkdir()
    for name, n in sizes.items():
        (folder / name).write_bytes(b"\0" * n)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return folder


def test_weights_count_every_shard_the_index_names_and_no_other_file(tmp_path):
    """A sharded checkpoint is every shard; a consolidated copy of the same weights beside it is not loaded."""
    target = _weights(tmp_path / "t", {"model-00001-of-00002.safetensors": 400, "model-00002-of-00002.safetensors": 200,
                                       "consolidated.safetensors": 600},
                      index={"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    dims = memfit.target_dims(_SMALL)  # float32 files served as float32
    assert memfit.weights_bytes(str(target), dims) == 600
    plain = _weights(tmp_path / "p", {"model-00001-of-00002.safetensors": 400, "model-00002-of-00002.safetensors": 200})
    assert memfit.weights_bytes(str(plain), dims) == 600  # no index: every safetensors file


def test_weights_shrink_for_a_narrower_engine_dtype_and_never_grow_for_a_wider_one(tmp_path):
    target = _weights(tmp_path / "t", {"model.safetensors": 800})
    assert memfit.weights_bytes(str(target), memfit.target_dims(_SMALL, engine_dtype="bfloat16")) == 400
    bf16 = {**_SMALL, "dtype": "bfloat16"}
    assert memfit.weights_bytes(str(target), memfit.target_dims(bf16, engine_dtype="float32")) == 800


@pytest.mark.parametrize("name,size", [("torch.float32", 4), ("torch.bfloat16", 2), ("torch.float16", 2),
                                       ("float8_e4m3fn", 1), ("torch.float8_e4m3fn", 1), ("auto-unknown", 2)])
def test_dtype_bytes_read_torch_names_as_transformers_writes_them(name, size):
    assert memfit.dtype_bytes(name) == size


def test_a_unit_needing_exactly_the_memory_available_fits():
    est = memfit.Estimate("one unit", "k", {"a": 1000, "b": 24})
    memfit.require_fit(est, available=1024)
    with pytest.raises(ConfigError, match=r"^k: one unit needs about .* more than the .* available; lower k$"):
        memfit.require_fit(est, available=1023)


def test_chunked_attention_scores_count_every_row():
    """Past attn_chunk_tokens, scores are one query chunk x the row's keys, per head and per row."""
    kw = dict(pack_tokens=256, hidden=8, num_aux=3, heads=2, head_dim=4, intermediate=12, draft_vocab=10,
              target_vocab=20, ttt_steps=3, attn_chunk_tokens=64, target_chunk_tokens=0)
    one, three = (memfit.train_estimate(rows=r, **kw) for r in (1, 3))
    assert one.parts["attention_scores"] == 2 * 64 * 256 * 4
    assert three.parts["attention_scores"] == 3 * one.parts["attention_scores"]


def test_one_captured_layer_has_its_hidden_state_slots():
    dims = memfit.target_dims(_SMALL)
    parts = memfit.engine_parts(dims, tokens=10, weights=0, capture_layers=1)
    assert parts["hidden_state_slots"] == 10 * 1 * 64 * 4


def test_an_absolute_path_is_not_put_under_the_base_folder(tmp_path):
    assert user_path(tmp_path / "data.jsonl", "k", error=StoreError, base_dir="/elsewhere") == tmp_path / "data.jsonl"
    assert user_path("data.jsonl", "k", error=StoreError, base_dir=tmp_path) == tmp_path / "data.jsonl"


@pytest.mark.parametrize("name", [".", ".."])
def test_an_output_folder_named_dot_or_dot_dot_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(StoreError, match=r"^--out: .* names no folder of its own"):
        check_output_dir(name, "--out", replaces=lambda p: True)
    if name == "..":  # pathlib reads sub/. as sub itself
        with pytest.raises(StoreError, match=r"names no folder of its own"):
            check_output_dir("sub/..", "--out", replaces=lambda p: True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_side_folder_of_a_live_process_is_no_orphan(tmp_path):
    mine = tmp_path / (pid_prefix(".out.tmp-") + "abc")
    mine.mkdir()
    gone = tmp_path / (pid_prefix(".out.tmp-", pid=2**22 + 12345) + "abc")  # above Linux's pid_max
    gone.mkdir()
    assert orphans(tmp_path, ".out.tmp-") == [gone]


def test_a_long_path_is_shown_by_its_end():
    path = "/" + "a" * 200 + "/features.lance"
    shown = shown_path(path)
    assert len(shown) == 120 and shown.endswith("/features.lance") and shown.startswith("...")


def test_max_model_len_at_the_targets_positions_is_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({**_SMALL, "max_position_embeddings": 512}))
    check_max_model_len(str(tmp_path), 512, where="ingest.engine")
    with pytest.raises(ConfigError, match=r"^ingest\.engine\.max_model_len: 513 is more than .* set "
                                          r"ingest\.engine\.max_model_len=512 or less$"):
        check_max_model_len(str(tmp_path), 513, where="ingest.engine")
    for allowed in ("1", "true", " TRUE "):  # as vLLM reads the variable
        monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", allowed)
        check_max_model_len(str(tmp_path), 100_000, where="ingest.engine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Leaf:
    n: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Root:
    name: str
    leaf: _Leaf = _Leaf()
    leaves: dict[str, _Leaf] = dataclasses.field(default_factory=dict)


def test_collecting_reports_every_problem_unknown_keys_included():
    """``ingest validate`` lists every problem: an unknown key beside a bad value, at each level, and no value."""
    problems: list[str] = []
    data = {"nmae": "x", "leaf": {"n": "one", "m": 2}, "leaves": {"a": {"n": 2, "k": 0}, "b": {"n": 3}}}
    assert build(_Root, data, problems=problems) is None
    assert problems == ["nmae: unknown key; did you mean name?", "name: required key is missing",
                        "leaf.m: unknown key", "leaf.n: expected int, got 'one'", "leaves.a.k: unknown key"]
    clean: list[str] = []
    assert build(_Root, {"name": "x", "leaves": {"b": {"n": 3}}}, problems=clean) == _Root(name="x",
                                                                                           leaves={"b": _Leaf(n=3)})
    assert clean == []


def test_a_renamed_key_names_its_new_place(toy):
    with pytest.raises(ConfigError, match=r"^train\.stream_depth: renamed to train\.stream\.depth$"):
        load_recipe(toy, ["train.stream_depth=2"])


def test_an_empty_recipe_is_refused_and_an_empty_mapping_runs_every_default(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match=r"empty \(no YAML document\); write \{\} to use every default"):
        load_recipe(str(empty))
    braces = tmp_path / "braces.yaml"
    braces.write_text("{}\n")
    assert load_recipe(str(braces)).to_dict()["train"] == load_recipe(str(braces), []).to_dict()["train"]
    # every default: run's as its dataclass declares them (the store's path is derived from the workdir)
    assert load_recipe(str(braces)).run.workdir == {f.name: f.default for f in dataclasses.fields(runconfig.RunConfig)}[
        "workdir"]


@pytest.mark.parametrize("text", ["- run: {}\n", "3\n", "just text\n"])
def test_a_recipe_that_is_no_mapping_is_refused(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r": the top level must be a mapping$"):
        load_recipe(str(p))


@pytest.mark.parametrize("typed", ["1.10", "2.0", "1e5", "-0.50"])
def test_a_decimal_typed_for_a_text_key_is_the_text_typed(toy, typed):
    """A run named 1.10 is not the run 1.1."""
    assert load_recipe(toy, [f"train.track.run_name={typed}"]).train.track.run_name == typed


def _short_target(folder: Path, positions: int) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_SMALL, "model_type": "llama",
                                                    "max_position_embeddings": positions}))
    return str(folder)


def test_engine_lengths_left_unset_are_fitted_to_a_short_target_and_given_ones_kept(toy, tmp_path):
    target = _short_target(tmp_path / "short", 1024)
    fitted = load_recipe(toy, [f"run.target={target}"])
    assert (fitted.ingest.engine.max_model_len, fitted.featurestore.engine.max_model_len,
            fitted.evaluate.engine.max_model_len, fitted.serve.max_model_len) == (1024, 1024, 1024, 1024)
    assert fitted.ingest.engine.dtype == load_recipe(toy).ingest.engine.dtype  # the rest of the engine section kept
    given = load_recipe(toy, [f"run.target={target}", "ingest.engine.max_model_len=2048", "serve.max_model_len=512"])
    assert (given.ingest.engine.max_model_len, given.serve.max_model_len) == (2048, 512)  # as given
    assert (given.featurestore.engine.max_model_len, given.evaluate.engine.max_model_len) == (1024, 1024)
    other = load_recipe(toy, [f"run.target={target}", "ingest.engine={dtype: float32}"])
    assert other.ingest.engine.max_model_len == 1024 and other.ingest.engine.dtype == "float32"


def test_a_literal_credential_typed_as_an_override_is_redacted_in_the_recorded_command(monkeypatch):
    """The argv a provenance file records: ``run.storage_options.<secret key>=value`` loses its value (the key
    names the secret; the value is whatever was typed), a ``${VAR}`` reference and other options are kept."""
    for name in [k for k in os.environ if any(w in k.upper() for w in ("SECRET", "TOKEN", "KEY", "PASSWORD"))]:
        monkeypatch.delenv(name)
    argv = ["ingest", "build", "run.storage_options.aws_secret_access_key=plainvalue1",
            "run.storage_options.aws_session_token=${AWS_SESSION_TOKEN}", "run.storage_options.aws_region=eu-west-1"]
    assert redact(argv) == ["ingest", "build", f"run.storage_options.aws_secret_access_key={REDACTED}",
                            "run.storage_options.aws_session_token=${AWS_SESSION_TOKEN}",
                            "run.storage_options.aws_region=eu-west-1"]


def test_a_urls_password_is_redacted_and_the_rest_of_it_kept():
    out = redact({"endpoints": ["https://alice:s3cr3t-pw@host.example:8000/v1", "http://host:8000/v1"],
                  "src": "s3://bucket/x?X-Amz-Signature=abcdef123&part=2"})
    assert out == {"endpoints": [f"https://alice:{REDACTED}@host.example:8000/v1", "http://host:8000/v1"],
                   "src": f"s3://bucket/x?X-Amz-Signature={REDACTED}&part=2"}


def _words(text: str) -> int:
    return len(text.split())


def test_a_registrys_record_ids_are_distinct_and_its_evidence_a_few_percent_in():
    """The question names one record by id: a second record of that id (or any repeated id) would make the
    answer ambiguous; the evidence sits 3-12% of the way in, never first (a far-back question, not the opening)."""
    for seed, tokens in [("a", 200), ("b", 400), ("c", 30_000)] + [(f"s{i}", 150) for i in range(30)]:
        text = material.document("records", seed=seed, tokens=tokens, count_tokens=_words)
        ids = re.findall(r"^Record (\d+):", text, flags=re.M)
        assert len(ids) == len(set(ids)), seed
        asked = re.search(r"what is the \w+ of record (\d+)\?", text).group(1)
        at, fillers = ids.index(asked), len(ids) - 1
        assert 1 <= at <= max(1, round(0.12 * fillers)), (seed, at, fillers)


def test_the_helper_a_code_question_describes_is_the_only_one_with_that_docstring():
    for seed in ("a", "b", "c", "d"):
        text = material.document("code", seed=seed, tokens=40_000, count_tokens=_words)
        doc = re.search(r'the helper documented as "([^"]+)"', text).group(1)
        assert text.count(f'"""{doc}"""') == 1, seed
