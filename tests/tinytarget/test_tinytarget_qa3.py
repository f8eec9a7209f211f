"""QA pass 3 on the tiny targets: the build CLI through the shared CLI layer, interrupted builds, odd sizes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.paths import staged_dir
from eaglenest.tinytarget import build, engine_check, long

SHORT = Path(__file__).resolve().parents[2] / "assets" / "tiny-target"


def _side_folders(parent):
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_ctrl_c_mid_build_is_one_line_and_leaves_no_side_folder(tmp_path, capsys, monkeypatch):
    # It bypassed the shared CLI layer: a KeyboardInterrupt came out of main() as a traceback.
    def interrupted(out, **kwargs):
        (out / "config.json").write_text("{}")  # half a model, in the staged folder
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "build", interrupted)
    out = tmp_path / "out"
    assert build.main(["--out", str(out), "--prompts-out", str(tmp_path / "prompts"), "--steps", "1"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["eaglenest-tiny-target: interrupted"]
    assert not out.exists() and _side_folders(tmp_path) == []


def test_sigterm_mid_build_unwinds_and_leaves_no_side_folder(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "eaglenest.tinytarget.build", "--out", str(out),
                             "--prompts-out", str(tmp_path / "prompts"), "--steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any((p / "tokenizer.json").exists() for p in tmp_path.glob(".out.tmp-*")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert err.strip().splitlines()[-1] == "eaglenest-tiny-target: terminated"
    assert not out.exists() and _side_folders(tmp_path) == []


def test_ctrl_c_mid_long_build_is_one_line_and_leaves_no_side_folder(tmp_path, capsys, monkeypatch):
    # The long build (hours) bypassed the shared CLI layer too: Ctrl-C was a traceback.
    def interrupted(out, cfg, *, phase_dir):
        with staged_dir(out, "--out", replaces=build.is_model_folder, error=ConfigError) as tmp:
            (tmp / "config.json").write_text("{}")
            raise KeyboardInterrupt

    monkeypatch.setattr(long, "build", interrupted)
    out = tmp_path / "long"
    argv = ["--base", str(SHORT), "--out", str(out), "--seed", "42", "--eval-buckets", "1024"]
    assert long.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["python -m eaglenest.tinytarget.long: interrupted"]
    assert not out.exists() and _side_folders(tmp_path) == []


@pytest.mark.parametrize("argv, says", [
    (["--max-model-len", "0"], "--max-model-len: must be >= 1, got 0"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization: must be in (0, 1], got 0.0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization: must be in (0, 1], got 1.5"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization: must be in (0, 1], got nan"),
])
def test_engine_check_refuses_engine_sizes_no_engine_can_take_before_it_starts(tmp_path, capsys, monkeypatch,
                                                                             argv, says):
    # They went to the engine as given: vLLM's traceback after its start, not one line naming the flag.
    def no_engine(*a, **k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine_check, "make_llm", no_engine)
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "x.jsonl").write_text('{"id": 1, "prompt": "Hi"}\n')
    assert engine_check.main(["--model", str(SHORT), "--prompts", str(prompts), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"python -m eaglenest.tinytarget.engine_check: error: {says}"]


def test_ctrl_c_during_the_engine_check_is_one_line(tmp_path, capsys, monkeypatch):
    # engine_check bypassed the shared CLI layer as well: Ctrl-C while the engine ran was a traceback.
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine_check, "run_check", interrupted)
    out = tmp_path / "report.json"
    assert engine_check.main(["--model", str(SHORT), "--prompts", str(tmp_path), "--json-out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["python -m eaglenest.tinytarget.engine_check: interrupted"]
    assert not out.exists()
