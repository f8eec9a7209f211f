"""``eaglenest-tiny-target``'s refusals: before any training and before the prompt files are written."""

from __future__ import annotations

import os

import pytest

from eaglenest.tinytarget.build import main


@pytest.mark.parametrize("make, says", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), "is a folder of other files"),
    (lambda p: p.write_text("a file"), "is a file; give a folder"),
])
def test_an_out_that_is_not_a_model_is_refused_and_nothing_is_written(tmp_path, capsys, make, says):
    # It was written into (the tokenizer first), or a traceback once the model was saved.
    out, prompts = tmp_path / "out", tmp_path / "prompts"
    make(out)
    assert main(["--out", str(out), "--prompts-out", str(prompts), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglenest-tiny-target: error: --out: ") and says in err and len(err.splitlines()) == 1
    assert not prompts.exists() and sorted(os.listdir(tmp_path)) == ["out"]


def test_prompts_out_that_cannot_be_made_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["--prompts-only", "--prompts-out", str(blocker / "data")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglenest-tiny-target: error: --prompts-out: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
    (["--seed", str(2 ** 63)], f"--seed must be in [0, 2**63), got {2 ** 63}"),
    # the prompts must not be drawn from the training stream (they would be training data)
    (["--seed", "5", "--prompt-seed", "5", "--steps", "1"], "--prompt-seed must differ from --seed"),
])
def test_bad_flags_are_one_line_and_nothing_is_written(tmp_path, capsys, argv, says):
    out, prompts = tmp_path / "out", tmp_path / "prompts"
    assert main(["--out", str(out), "--prompts-out", str(prompts), *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"eaglenest-tiny-target: error: {says}"]
    assert os.listdir(tmp_path) == []
