"""Bad input to the tiny-target builders (``eaglenest.tinytarget.long``, ``.archs``, ``.engine_check``)
refused in one line before any training or engine start, naming the flag or value to change; the
architecture builder's folder written whole or not at all. All CPU, no vLLM engine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.tinytarget import archs, engine_check
from eaglenest.tinytarget.long import main
from eaglenest.tinytarget.longconfig import LongConfig, parse_stages

ROOT = Path(__file__).resolve().parents[2]
SHORT = ROOT / "assets" / "tiny-target"
#: A cheap first stage: if a refusal came only after training, this is what it would have cost.
CHEAP = "128x1x1:repeat64"


def _refused(capsys, argv: list[str], tmp_path: Path) -> str:
    """Run the long builder; it must exit 2 with one error line and leave --out unwritten."""
    out = tmp_path / "never"
    assert main(["--out", str(out), "--base", str(SHORT), "--seed", "42", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("python -m eaglenest.tinytarget.long: error: "), err
    assert not out.exists()
    return err


@pytest.mark.parametrize("stages, says", [
    ("256x1x1x-5", "256x1x1x-5"),        # a negative packed size was ignored (one prompt per row)
    ("256x1x1x256", "256x1x1x256"),      # packed prompts as long as the row: none packed
    ("8192x1x1x120", "8192x1x1x120"),    # 68 packed prompts (64 at most): an assertion mid-training
])
def test_a_packed_size_that_cannot_pack_is_refused(stages, says):
    with pytest.raises(ConfigError, match=f"stages: .*{says}"):
        LongConfig(stages=parse_stages(stages))


@pytest.mark.parametrize("stages, says", [
    (f"{CHEAP},256x1x1:code", "256x1x1:code"),        # a code prompt needs more than 256 - 48 tokens
    (f"{CHEAP},128x1x1", "128x1x1"),                  # the default kinds: records cannot fit 128
    (f"{CHEAP},1024x1x1x150:code", "1024x1x1x150:code"),
])
def test_a_stage_too_short_for_its_kinds_is_refused_before_training(tmp_path, capsys, stages, says):
    # It trained the stages before it, then died with a traceback on the stage's first row.
    err = _refused(capsys, ["--stages", stages, "--eval-buckets", "1024"], tmp_path)
    assert f"stages: {says}: " in err and "too short" in err


@pytest.mark.parametrize("buckets, says", [
    ("0", "eval_buckets: token counts >= 1, got 0"),
    ("200", "eval_buckets: evaluate.context_buckets: 200 tokens is too short"),  # found after training
    ("1024,1024", "eval_buckets: 1024 twice"),
    ("1024,65536", "eval_buckets: 65536 is over max_positions 32768"),  # measured at 32K, called 64K
    ("1024,", "--eval-buckets: cannot read '1024,'"),  # it said "invalid literal for int()", naming no flag
])
def test_bad_eval_buckets_are_refused_before_training(tmp_path, capsys, buckets, says):
    err = _refused(capsys, ["--stages", CHEAP, "--eval-buckets", buckets], tmp_path)
    assert says in err


@pytest.mark.parametrize("argv, says", [
    (["--eval-prompts", "0"], "eval_prompts_per_bucket: must be >= 1, got 0"),
    (["--peak-lr", "0"], "peak_lr: must be > 0, got 0"),
    (["--peak-lr=-1e-3"], "peak_lr: must be > 0, got -0.001"),
    (["--peak-lr", "nan"], "peak_lr: must be a finite number, got nan"),
    (["--rope-theta", "inf"], "rope_theta: must be a finite number, got inf"),
    (["--weight-decay", "nan"], "weight_decay: must be a finite number, got nan"),
    (["--token-weight", "nan"], "token_weight: must be a finite number, got nan"),
    (["--seed", "one"], "--seed: cannot read 'one'"),
    (["--peak-lr", "fast"], "--peak-lr: cannot read 'fast'"),
    (["--eval-prompts", "4.5"], "--eval-prompts: cannot read '4.5'"),
])
def test_bad_numbers_are_one_line_naming_the_flag(tmp_path, capsys, argv, says):
    err = _refused(capsys, ["--stages", CHEAP, "--eval-buckets", "1024", *argv], tmp_path)
    assert says in err


@pytest.mark.parametrize("text, says", [
    ("raw_fraction: 2\n", "raw_fraction: must be in [0, 1], got 2"),
    ("num_held_out: 0\n", "num_held_out: must be >= 1, got 0"),
    ("eval_buckets: [-1024]\n", "eval_buckets: token counts >= 1, got -1024"),
])
def test_bad_recipe_numbers_are_refused(tmp_path, capsys, text, says):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: {CHEAP}\n" + text)
    err = _refused(capsys, ["--recipe", str(recipe)], tmp_path)
    assert says in err


def _two_phase_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "phases.yaml"
    recipe.write_text(f"eval_buckets: [1024]\nphases:\n  - name: one\n    stages: {CHEAP}\n"
                      f"  - name: two\n    stages: {CHEAP}\n")
    return recipe


def test_a_phase_dir_that_cannot_hold_the_phases_is_refused_before_training(tmp_path, capsys):
    # The docs promise it; it trained the first phase, then died with a traceback saving it.
    blocker = tmp_path / "phases-file"
    blocker.write_text("not a folder")
    err = _refused(capsys, ["--recipe", str(_two_phase_recipe(tmp_path)), "--phase-dir", str(blocker)], tmp_path)
    assert f"--phase-dir: {blocker}" in err and "not a directory" in err
    other = tmp_path / "phases"
    (other / "one").mkdir(parents=True)
    (other / "one" / "notes.txt").write_text("mine")
    err = _refused(capsys, ["--recipe", str(_two_phase_recipe(tmp_path)), "--phase-dir", str(other)], tmp_path)
    assert f"--phase-dir: {other / 'one'} is a folder of other files" in err
    assert (other / "one" / "notes.txt").read_text() == "mine" and not (other / "two").exists()


def test_a_phase_dir_without_phases_is_refused(tmp_path, capsys):
    # It was ignored: a user resuming later found nothing saved.
    err = _refused(capsys, ["--stages", CHEAP, "--eval-buckets", "1024", "--phase-dir", str(tmp_path / "ph")],
                   tmp_path)
    assert "--phase-dir: " in err and "phases" in err and not (tmp_path / "ph").exists()


@pytest.mark.parametrize("damage, says", [
    (lambda b: (b / "model.safetensors").unlink(), "no weights"),
    (lambda b: (b / "config.json").write_text("{not json"), "config.json: not valid JSON"),
])
def test_a_base_with_missing_or_broken_files_is_one_line(tmp_path, capsys, damage, says):
    base = tmp_path / "base"
    shutil.copytree(SHORT, base)
    damage(base)
    out = tmp_path / "never"
    assert main(["--out", str(out), "--base", str(base), "--stages", CHEAP, "--eval-buckets", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--base: {base}" in err and says in err, err
    assert not out.exists()


# --- engine_check: what it would check is read before an engine starts --------------------------

@pytest.mark.parametrize("setup, argv, says", [
    (lambda d: None, [], "no prompt files"),                                   # a missing folder passed
    (lambda d: d.mkdir(), [], "no prompt files"),                              # so did an empty one
    (lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"id": 1, "prompt": "Hi"}\n')),
     ["--num-per-domain", "0"], "--num-per-domain: must be >= 1, got 0"),      # checked no chat, exit 0
    (lambda d: (d.mkdir(), (d / "x.jsonl").write_text('{"id": 1, "prompt": "Hi"\n')),
     [], "x.jsonl: line 1 is not a JSON object"),                              # a traceback
])
def test_engine_check_refuses_what_would_check_nothing(tmp_path, capsys, monkeypatch, setup, argv, says):
    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_check, "make_llm", no_engine)
    prompts = tmp_path / "prompts"
    setup(prompts)
    assert engine_check.main(["--model", str(SHORT), "--prompts", str(prompts), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_engine_check_json_out_that_cannot_be_written_is_refused_before_the_engine(tmp_path, capsys, monkeypatch):
    """A --json-out under a regular file (or in a folder that cannot be made) was a traceback after the
    engine had run a minute; now one line before it starts."""
    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_check, "make_llm", no_engine)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "x.jsonl").write_text('{"id": 1, "prompt": "Hi"}\n')
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "report.json"
    assert engine_check.main(["--model", str(SHORT), "--prompts", str(prompts), "--json-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--json-out" in err and str(tmp_path / "file") in err, err


# --- archs: the folder written whole or not at all ---------------------------------------------

def test_an_arch_build_refuses_a_folder_of_other_files_and_leaves_it_alone(tmp_path, capsys):
    # It wrote its config, weights and tokenizer among the user's files.
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert archs.main(["qwen3", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out} is a folder of other files" in err
    assert os.listdir(out) == ["notes.txt"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert archs.main(["qwen3", str(blocker)]) == 2  # a traceback
    assert "is a file" in capsys.readouterr().err and blocker.read_text() == "x"


def test_an_arch_build_replaces_an_earlier_build_whole(tmp_path):
    # Building qwen3 over a qwen3_vl folder left the VL processor files beside the text model.
    out = archs.build("qwen3_vl", tmp_path / "target")
    assert (out / "preprocessor_config.json").is_file()
    archs.build("qwen3", out)
    assert not (out / "preprocessor_config.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    assert [p.name for p in tmp_path.iterdir()] == ["target"]  # no side folder left


def test_a_killed_arch_build_leaves_no_folder_that_looks_finished(tmp_path, monkeypatch):
    # save_pretrained wrote config.json into OUT first: a build killed while writing the weights left a
    # folder a later stage took for a model.
    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(archs, "_processor_files", killed)
    out = tmp_path / "target"
    with pytest.raises(KeyboardInterrupt):
        archs.build("qwen3_vl", out)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_the_long_targets_config_and_card_describe_what_was_built(tmp_path):
    # The config kept the base's 32768 positions whatever max_positions the build trained and measured
    # to, and the card called the base's RoPE base 1e4 whatever it was.
    from eaglenest.tinytarget.long import build

    base = tmp_path / "base"
    shutil.copytree(SHORT, base)
    config = json.loads((base / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path / "long"
    build(out, LongConfig(base=str(base), max_positions=4096, rope_theta=2e6, stages=parse_stages(CHEAP),
                          eval_buckets=(1024,), eval_prompts_per_bucket=1, num_held_out=4))
    built = json.loads((out / "config.json").read_text())
    assert built["max_position_embeddings"] == 4096 and built["rope_parameters"]["rope_theta"] == 2e6
    card = (out / "README.md").read_text()
    assert "up to\n4096 tokens" in card and "RoPE base 2e+06 (the base's: 500000)." in card and "1e4" not in card
    assert f"python -m eaglenest.tinytarget.long --out assets/tiny-target-long --base {base} --seed 1 " in card


# --- more refusals before any work ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["../outside", "a/b", "", "-dash"])
def test_a_phase_name_that_is_no_folder_name_is_refused(tmp_path, capsys, name):
    # --phase-dir saved the phase at DIR/NAME: '../outside' wrote beside DIR, '' onto DIR itself.
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"eval_buckets: [1024]\nphases:\n  - name: {json.dumps(name)}\n    stages: {CHEAP}\n")
    err = _refused(capsys, ["--recipe", str(recipe), "--phase-dir", str(tmp_path / "ph")], tmp_path)
    assert f"phases[0]: name {name!r}: letters, digits" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_a_base_with_a_broken_provenance_is_refused_before_training(tmp_path, capsys):
    # Its provenance is read for the card once training is over: a traceback, the training lost.
    base = tmp_path / "base"
    shutil.copytree(SHORT, base)
    (base / "provenance.json").write_text('{"metrics": {"held_out"')
    out = tmp_path / "never"
    assert main(["--out", str(out), "--base", str(base), "--stages", CHEAP, "--eval-buckets", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{base / 'provenance.json'}: not valid JSON" in err, err
    assert not out.exists()


def test_remeasure_of_a_folder_with_a_broken_provenance_is_one_line(tmp_path, capsys):
    out = tmp_path / "built"
    shutil.copytree(SHORT, out)
    (out / "provenance.json").write_text("[1, 2")
    assert main(["--out", str(out), "--base", str(SHORT), "--remeasure", "--eval-buckets", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out / 'provenance.json'}: not valid JSON" in err, err
    assert (out / "provenance.json").read_text() == "[1, 2"


@pytest.mark.parametrize("inside", ["data", "."])
def test_prompt_files_inside_the_model_folder_are_refused(tmp_path, capsys, inside):
    # Written into --out, they were deleted with the earlier model when the new one replaced it.
    from eaglenest.tinytarget.build import main as build_main

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    prompts = out / inside
    assert build_main(["--out", str(out), "--prompts-out", str(prompts), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--prompts-out: {prompts} is inside --out {out}" in err, err
    assert os.listdir(out) == ["config.json"]


def test_a_resume_from_a_base_that_is_not_the_earlier_phases_is_refused(tmp_path, capsys):
    # Resumed from the plain tiny target it trained phase two alone and its card said "the result is
    # the same" as the whole build.
    recipe = _two_phase_recipe(tmp_path)
    err = _refused(capsys, ["--recipe", str(recipe), "--from-phase", "two"], tmp_path)
    assert f"--from-phase two: --base {SHORT} is not the output of the recipe's phases before it" in err
    assert "holds phases: none" in err


@pytest.mark.parametrize("seed", [str(2**64), "-1"])
def test_a_seed_torch_cannot_take_is_refused(tmp_path, capsys, seed):
    # 2**64: torch.manual_seed's "Overflow when unpacking long long" traceback, the prompt files already
    # rewritten (the tiny build) or the tokenizer and model loaded (the long one).
    from eaglenest.tinytarget.build import main as build_main

    err = _refused(capsys, ["--stages", CHEAP, "--eval-buckets", "1024", f"--seed={seed}"], tmp_path)
    assert f"seed: must be in [0, 2**63), got {seed}" in err
    prompts = tmp_path / "prompts"
    assert build_main(["--out", str(tmp_path / "model"), "--prompts-out", str(prompts), f"--seed={seed}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"eaglenest-tiny-target: error: --seed must be in [0, 2**63), got {seed}"
    assert not prompts.exists() and not (tmp_path / "model").exists()


def test_a_setting_every_phase_overrides_is_refused_not_ignored(tmp_path, capsys):
    # `--recipe R --stages 128x1x1` (to try a recipe quickly) trained the phases' own stages instead.
    err = _refused(capsys, ["--recipe", str(_two_phase_recipe(tmp_path)), "--stages", "256x1x1:repeat64"], tmp_path)
    assert "stages: every phase of the recipe sets its own" in err
