"""Without -v, vLLM's INFO lines go to <workdir>/logs/vllm.log and only its warnings reach the
console; with -v (or a user's own VLLM_LOGGING_* setting) vLLM logs as it always does (issue 12).
The CLI only names the folder; nothing is written there until an engine starts (issue 23)."""

from __future__ import annotations

import os
import subprocess
import sys

from eaglenest import engine
from eaglenest.engine import VLLM_LOG_ENV, defer_quiet_vllm, quiet_vllm

# What vllm.LLM(...) and the engine processes do first: apply the logging config the environment
# describes (vllm/entrypoints/llm.py -> configure_logging_if_needed), then log.
PROBE = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging_if_needed, init_logger
configure_logging_if_needed(LoggingConfig())
log = init_logger("vllm.probe")
log.info("probe-info-line")
log.warning("probe-warning-line")
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in VLLM_LOG_ENV}


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)


def _clear(monkeypatch):
    """No VLLM_LOGGING_* (as in a user's shell); whatever the calls below set is undone afterwards."""
    for k in VLLM_LOG_ENV:
        monkeypatch.setenv(k, "x")  # recorded, so the teardown restores the value before the test
        monkeypatch.delenv(k)
    monkeypatch.setattr(engine, "_deferred_log_dir", None)  # this process's deferred folder, restored after


def test_info_to_the_run_log_warnings_to_the_console(tmp_path, monkeypatch):
    _clear(monkeypatch)
    assert defer_quiet_vllm(tmp_path / "logs", verbose=0)
    assert not (tmp_path / "logs").exists()  # only remembered: a refused command writes nothing
    path = quiet_vllm()  # an engine is about to start
    assert path == tmp_path / "logs" / "vllm.log"
    assert quiet_vllm() == path  # once per process tree
    out = _probe(dict(os.environ))  # what an engine process inherits
    assert out.returncode == 0, out.stderr
    console = out.stdout + out.stderr
    assert "probe-info-line" not in console and "probe-warning-line" in console
    text = path.read_text()
    assert "probe-info-line" in text and "probe-warning-line" in text


def test_verbose_or_user_setting_leaves_vllm_alone(tmp_path, monkeypatch):
    _clear(monkeypatch)
    assert not defer_quiet_vllm(tmp_path / "logs", verbose=1)
    assert quiet_vllm() is None
    assert not any(k in os.environ for k in VLLM_LOG_ENV)
    out = _probe(_clean_env())
    assert "probe-info-line" in out.stdout + out.stderr  # vLLM's default: INFO on the console
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert not defer_quiet_vllm(tmp_path / "logs2", verbose=0)
    assert quiet_vllm() is None and not (tmp_path / "logs2").exists()
