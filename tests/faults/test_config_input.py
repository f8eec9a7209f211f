"""Hostile or bad recipe, manifest and override input: exit code 2 and one short line, quickly.

Issue #10. An alias bomb ("billion laughs") used to be expanded into an error message (minutes and
gigabytes), non-finite floats were accepted, and duplicate layer ids went through. The CLI bombs
here use 7 levels of 9 aliases, not 9: on a regression that still expands them, the test fails in
seconds (a ~30 MB message) instead of exhausting the machine; the 9-level bomb is parsed directly.
"""

from __future__ import annotations

import time

import pytest

from eaglenest.config import MAX_YAML_BYTES, build, load_yaml, short
from eaglenest.errors import ConfigError, ManifestError
from eaglenest.featurestore.capture.engine import resolve_layer_ids
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.train.config import TrainConfig

LINE_CHARS = 500


@pytest.fixture
def recipe(root):
    return str(root / "recipes" / "toy.yaml")


def _bomb(levels: int, width: int = 9) -> str:
    """A flow sequence of ``levels`` anchored lists, each holding ``width`` aliases of the previous."""
    parts = [f"&a0 [{', '.join(['lol'] * width)}]"]
    parts += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(parts)}]"


def _one_short_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < LINE_CHARS, (len(lines), [len(x) for x in lines[:3]])
    return lines[0]


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    assert time.perf_counter() - t0 < 5, "bad input must be refused quickly"
    return out


def test_alias_bomb_is_refused_before_expansion(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(f"train:\n  lr: {_bomb(9)}\n")
    with pytest.raises(ConfigError, match=r"bomb\.yaml: line 2: YAML aliases"):
        _timed(load_yaml, p)
    with pytest.raises(ManifestError, match="aliases"):
        _timed(lambda: load_yaml(p, error=ManifestError))


def test_alias_bomb_recipe_exits_2_with_one_line(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text(f"run:\n  workdir: {tmp_path}\ntrain:\n  lr: {_bomb(7)}\n")
    assert _timed(train_main, ["run", "--recipe", str(p), "--dry-run"]) == 2
    line = _one_short_line(capsys.readouterr().err)
    assert str(p) in line and "line 4" in line and "alias" in line


def test_alias_bomb_manifest_exits_2_with_one_line(tmp_path, capsys, recipe):
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\ngeneration:\n  temperature: {_bomb(7)}\n")
    assert _timed(ingest_main, ["validate", "--recipe", recipe, "--manifest", str(m)]) == 2
    line = _one_short_line(capsys.readouterr().err)
    assert str(m) in line and "line 3" in line and "alias" in line


@pytest.mark.parametrize("value, says", [(_bomb(7), ": line 1: YAML aliases (*a0) are not allowed"),
                                         ("&a [*a, *a]", ": expected"), ("&a [1, *a]", ": expected")])
def test_alias_in_override_is_not_expanded(capsys, recipe, value, says):
    # A list or mapping holding an alias is refused as the recipe loader refuses one, naming the key; a
    # value starting with an anchor is a plain string, refused by the type check like any other bad value.
    for key in ("train.lr", "evaluate.context_buckets"):
        assert _timed(train_main, ["run", "--recipe", recipe, "--dry-run", f"{key}={value}"]) == 2
        assert _one_short_line(capsys.readouterr().err).startswith(f"train: error: {key}{says}")


@pytest.mark.parametrize("value, says", [("9" * 5000, ": expected int"),
                                         ("[" * 5000 + "]" * 5000, ": line 1: nested too deeply")])
def test_unparsable_override_values_exit_2(capsys, recipe, value, says):
    # A 5000-digit integer (Python's int-string limit) or nesting past the recursion limit.
    assert _timed(train_main, ["run", "--recipe", recipe, "--dry-run", f"train.num_epochs={value}"]) == 2
    assert _one_short_line(capsys.readouterr().err).startswith(f"train: error: train.num_epochs{says}")


def test_a_mapping_override_with_a_key_that_is_no_text_says_so(capsys, recipe):
    """``run.storage_options={1: x}``: the loader refused the int key, the override fell back to the text
    typed, and the line said "expected a mapping, got str" (the user gave a mapping)."""
    assert _timed(train_main, ["run", "--recipe", recipe, "--dry-run", "run.storage_options={1: x}"]) == 2
    assert _one_short_line(capsys.readouterr().err) == (
        "train: error: run.storage_options: line 1: the key 1 is read as int, not text; quote it")


def test_deeply_nested_recipe_exits_2(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  lr: " + "[" * 5000 + "]" * 5000 + "\n")
    assert _timed(train_main, ["run", "--recipe", str(p), "--dry-run"]) == 2
    assert "nested too deeply" in _one_short_line(capsys.readouterr().err)


def test_oversized_yaml_is_refused_unread(tmp_path, capsys, root):
    p = tmp_path / "r.yaml"
    text = (root / "recipes" / "toy.yaml").read_text()
    p.write_text(text + "#" * (MAX_YAML_BYTES - len(text) + 1) + "\n")  # a valid recipe, padded
    assert _timed(train_main, ["run", "--recipe", str(p), "--dry-run"]) == 2
    assert "larger than" in _one_short_line(capsys.readouterr().err)


@pytest.mark.parametrize("text", ["train:\n  lr: [" + "0, " * 12_000 + "0]\n", "- 0\n" * 12_000])
def test_too_many_values_are_refused_while_parsing(tmp_path, capsys, text):
    # A huge list, in a key or as the whole recipe: refused at the value limit, not echoed.
    p = tmp_path / "r.yaml"
    p.write_text(text)
    assert _timed(train_main, ["run", "--recipe", str(p), "--dry-run"]) == 2
    assert "more than 10000 values" in _one_short_line(capsys.readouterr().err)


def test_unreadable_recipe_path_exits_2(capsys):
    assert train_main(["run", "--recipe", "r" * 300 + ".yaml", "--dry-run"]) == 2  # ENAMETOOLONG
    assert "cannot be read" in _one_short_line(capsys.readouterr().err)


@pytest.mark.parametrize("override", ["train.lr=.inf", "train.lr=1.0e+400", "train.grad_clip=.inf",
                                      "train.weight_decay=.nan", "evaluate.temperature=.nan",
                                      "featurestore.write_buffer_mb=.inf", "ingest.request_timeout_s=-.inf",
                                      f"train.lr={10 ** 400}"])
def test_non_finite_floats_exit_2(capsys, recipe, override):
    key = override.split("=")[0]
    assert train_main(["run", "--recipe", recipe, "--dry-run", override]) == 2
    assert _one_short_line(capsys.readouterr().err) == f"train: error: {key}: must be a finite number"


@pytest.mark.parametrize("kwargs, key", [
    ({"lr": float("nan")}, "train.lr"), ({"lr": -1.0}, "train.lr"),
    ({"seed": -1}, "train.seed"), ({"table_version": -1}, "train.table_version"),
    ({"grad_clip": float("inf")}, "train.grad_clip"), ({"seed": 2 ** 64}, "train.seed"),
])
def test_train_ranges_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("seed", [-1, 2 ** 63])
def test_run_seed_range(capsys, recipe, seed):
    # Both ends: the upper one was untested (dropping it from RunConfig left this test passing).
    assert train_main(["run", "--recipe", recipe, "--dry-run", f"run.seed={seed}"]) == 2
    assert _one_short_line(capsys.readouterr().err) == f"train: error: run.seed: must be in [0, 2**63), got {seed}"
    assert train_main(["run", "--recipe", recipe, "--dry-run", f"run.seed={2 ** 63 - 1}"]) == 0


def test_duplicate_and_last_layer_ids_are_refused(tiny_target):
    from eaglenest.featurestore.capture.build import feature_meta

    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: .*duplicate.*\[2\]"):
        feature_meta(str(tiny_target), [2, 2, 2], "auto")
    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: .*\[4\]"):
        resolve_layer_ids([4, 2, 4, 5], 8)
    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: 8 is the last layer"):
        resolve_layer_ids([2, 4, 8], 8)
    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: \[9\] outside 0\.\.7 \(vLLM convention"):
        resolve_layer_ids([2, 4, 9], 8)  # the range the last-layer refusal names (it said 0..8)
    assert resolve_layer_ids([5, 2, 4], 8) == (5, 2, 4)  # the order given is kept
    assert resolve_layer_ids([], 8) == (2, 4, 5)


BIG = "x" * 1_000_000


@pytest.mark.parametrize("data", [{"lr": BIG}, {BIG: 1}, {"state": {"resume": BIG}}, {"sliding_window": BIG},
                                  {"seed": [BIG] * 10}, {"table_version": 10 ** 4000}])
def test_huge_values_are_echoed_bounded(data):
    with pytest.raises(ConfigError) as exc:
        build(TrainConfig, data, where="train")
    msg = str(exc.value)
    assert len(msg) < LINE_CHARS and "\n" not in msg and msg.startswith("train.")


def test_huge_override_is_echoed_bounded(capsys, recipe):
    assert train_main(["run", "--recipe", recipe, "--dry-run", "serve.dtype=" + "y" * 100_000]) == 2
    assert _one_short_line(capsys.readouterr().err).startswith("train: error: serve.dtype: 'yyy")
    assert train_main(["run", "--recipe", recipe, "--dry-run", "train." + "k" * 100_000 + "=1"]) == 2
    assert "unknown key" in _one_short_line(capsys.readouterr().err)


def test_short():
    assert short("abc") == "'abc'"
    assert short(list(range(10 ** 6))) == "[0, 1, 2, 3, 4, 5, ...]"
    s = short({"k" * 10 ** 6: ["v" * 10 ** 6] * 10 ** 6}, limit=80)
    assert len(s) == 80 and s.endswith("...")


def test_capture_layer_ids_out_of_layer_order_are_refused(tiny_target):
    # vLLM sorts a capture's aux layers (its aux_hidden_state_layers); the table recorded (5, 2, 4) over data
    # in order 2, 4, 5, and a draft trained on it read each layer's states as another's.
    from eaglenest.featurestore.capture.build import feature_meta

    with pytest.raises(ConfigError, match=r"featurestore.layer_ids: \[5, 2, 4\] is not ascending.*give \[2, 4, 5\]"):
        feature_meta(str(tiny_target), [5, 2, 4], "auto")
    assert feature_meta(str(tiny_target), [2, 4, 5], "auto").layer_ids == (2, 4, 5)
