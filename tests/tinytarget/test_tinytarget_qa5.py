"""QA pass 5 on the tiny targets: the architecture builder's CLI through the shared CLI layer."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from eaglenest.tinytarget import archs, engine_check

PROG = "python -m eaglenest.tinytarget.archs"
SHORT = Path(__file__).resolve().parents[2] / "assets" / "tiny-target"


def _side_folders(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_ctrl_c_mid_arch_build_is_one_line_and_leaves_no_side_folder(tmp_path, capsys, monkeypatch):
    # archs.main bypassed the shared CLI layer: Ctrl-C came out of main() as a KeyboardInterrupt traceback.
    def interrupted(spec, out, *, seed):
        (out / "config.json").write_text("{}")  # half a model, in the staged folder
        raise KeyboardInterrupt

    monkeypatch.setattr(archs, "_write", interrupted)
    out = tmp_path / "target"
    assert archs.main(["qwen3", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [f"{PROG}: interrupted"]
    assert not out.exists() and _side_folders(tmp_path) == []


def test_unknown_arch_is_one_line_naming_it_and_the_choices(tmp_path, capsys):
    assert archs.main(["mamba", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{PROG}: error: unknown architecture 'mamba'; one of {', '.join(archs.ARCHS)}"]
    assert not (tmp_path / "t").exists()


def test_verbose_flag_sets_up_logging_like_every_command(tmp_path, monkeypatch):
    # `-v` was a usage error (two positional arguments exactly) and no command logged anything.
    monkeypatch.setattr(archs, "build", lambda arch, out: out)
    monkeypatch.setattr(logging.getLogger("eaglenest"), "level", logging.NOTSET)
    assert archs.main(["-v", "qwen3", str(tmp_path / "t")]) == 0
    assert logging.getLogger("eaglenest").level == logging.INFO


def test_help_names_every_arch(capsys):
    with pytest.raises(SystemExit) as exit_:
        archs.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {PROG}") and all(arch in out for arch in archs.ARCHS)


# --- engine_check: its refusals name its own flags -------------------------------------------------

ECHECK = "python -m eaglenest.tinytarget.engine_check"


@pytest.mark.parametrize("model, says", [("nosuch", "no such directory"), ("empty", "is not a model directory")])
def test_engine_check_names_model_flag_not_a_recipe_key_it_has_none_of(tmp_path, capsys, model, says):
    # `--model /nonexist` said "run.target: /nonexist: no such directory": a key of a recipe the command has not.
    (tmp_path / "empty").mkdir()
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "x.jsonl").write_text('{"id": 1, "prompt": "Hi"}\n')
    path = tmp_path / model
    assert engine_check.main(["--model", str(path), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{ECHECK}: error: --model: {path}") and says in err[0], err
    assert "run.target" not in err[0]


@pytest.mark.parametrize("line, says", [
    ('{"id": 1, "prompt": 5}', "'prompt' must be text, got int 5"),
    ('{"id": 1, "prompt": null}', "'prompt' must be text, got NoneType None"),
    ('{"id": 1, "prompt": "Hi", "system": ["be brief"]}', "'system' must be text, got list ['be brief']"),
])
def test_engine_check_refuses_a_prompt_line_that_is_not_text_before_the_engine(tmp_path, capsys, monkeypatch,
                                                                              line, says):
    # A prompt line whose prompt is not text went to the engine, started first (half a minute on CPU).
    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_check, "make_llm", no_engine)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "x.jsonl").write_text('{"id": 0, "prompt": "fine"}\n' + line + "\n")
    assert engine_check.main(["--model", str(SHORT), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{ECHECK}: error: --prompts: {prompts / 'x.jsonl'}: line 2: {says}"]
