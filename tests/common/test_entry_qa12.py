"""Ctrl-C while a console script still imports its command (QA pass 12): one line and SIGINT, no traceback.

The console scripts of ``[project.scripts]`` run as installed in the environment (``.venv/bin``): a real
process, a real SIGINT. A slow import (a cold disk cache, a network file system) is made certain with a
``sitecustomize`` that holds the import of ``eaglenest.cli``, which every command imports before its
``main`` runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

#: The console scripts, as ``[project.scripts]`` names them, and the argv each is given.
SCRIPTS = {"ingest": ["build"], "featurestore": ["capture"], "train": ["run"], "serve": ["export"],
           "evaluate": ["al"], "eaglenest-tiny-target": ["--prompts-only"]}

#: Holds the import of ``eaglenest.cli`` (or of ``EAGLENEST_QA_HOLD``), saying so on stdout when
#: ``EAGLENEST_QA_SAY`` is set.
_SLOW_IMPORT = """
import os, sys, time

class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("EAGLENEST_QA_HOLD", "eaglenest.cli"):
            if os.environ.get("EAGLENEST_QA_SAY"):
                print("importing", flush=True)
            time.sleep(30)
        return None

sys.meta_path.insert(0, _Slow())
"""


def _start(tmp_path: Path, script: str, *, say: bool, hold: str = "eaglenest.cli") -> subprocess.Popen:
    exe = Path(sys.executable).parent / script
    assert exe.exists(), f"{exe}: the console script is not installed (pip install -e .)"
    # an environment installed before [project.scripts] last changed runs another entry point: say so plainly
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][script]
    installed = entry_points(group="console_scripts")[script].value
    assert installed == declared, f"{exe} runs {installed}, pyproject.toml names {declared}: pip install -e ."
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SLOW_IMPORT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}
    env.pop("EAGLENEST_QA_SAY", None)
    env["EAGLENEST_QA_HOLD"] = hold
    if say:
        env["EAGLENEST_QA_SAY"] = "1"
    return subprocess.Popen([str(exe), *SCRIPTS[script]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env)


def _interrupted(proc: subprocess.Popen) -> str:
    """Ctrl-C once the script says it is importing its command; its stderr."""
    try:
        assert proc.stdout.readline().strip() == "importing"
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=60)[1]
    finally:
        proc.kill()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_ctrl_c_while_the_command_imports_ends_it_with_one_line(tmp_path, script):
    proc = _start(tmp_path, script, say=True)
    err = _interrupted(proc)
    assert "Traceback" not in err, err
    assert err.splitlines() == [f"{script}: interrupted"]
    # ended by SIGINT, as a Ctrl-C once the command runs ends it: a shell sees 130 and a loop running it stops
    assert proc.returncode == -signal.SIGINT


@pytest.mark.parametrize("script, module", [("ingest", "eaglenest.ingest.cli"),
                                            ("train", "eaglenest.pipeline.train_cli"),
                                            ("eaglenest-tiny-target", "eaglenest.tinytarget.build")])
def test_ctrl_c_as_the_guard_starts_importing_the_command_is_one_line(tmp_path, script, module):
    """The earliest moment the guard covers, made certain: the import of the command's own module is held
    (before any of it runs), not reached by a sleep of a guessed length."""
    proc = _start(tmp_path, script, say=True, hold=module)
    err = _interrupted(proc)
    assert err.splitlines() == [f"{script}: interrupted"], err
    assert proc.returncode == -signal.SIGINT


def test_python_m_still_runs_the_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eaglenest.ingest.cli", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and "validate" in proc.stdout, proc.stderr


def test_an_entry_point_loaded_in_process_takes_its_argv(tmp_path, capsys):
    # tests/archs loads the installed console script's entry point and calls it with an argv
    main = entry_points(group="console_scripts")["ingest"].load()
    assert main(["validate", "--manifest", str(tmp_path / "no such manifest.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("ingest: error:") and "no such manifest.yaml" in err[0], err
