"""``train launch``'s stop marker, hostile pass 9: the file a launcher's ranks create when they say a stop
(``eaglenest.launch.STOP_SAID_ENV``) outlived a SIGKILLed launcher in the temp folder, one more per killed
launch; the next launch removes such leftovers, says its own stop once and leaves nothing behind. Real
processes: torchrun's agent, ranks that are eaglenest commands; no engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from launch_helpers import LAUNCHER as _LAUNCHER, RANK as _RANK  # on sys.path via conftest

pytestmark = pytest.mark.timeout(240)

_MARKER = "eaglenest-stop-said-"


def _env(tmp) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp)}
    for k in ("TORCH_CPP_LOG_LEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
              "EAGLENEST_STOP_SAID"):
        env.pop(k, None)
    return env


def _markers(tmp) -> list[str]:
    return sorted(p for p in os.listdir(tmp) if p.startswith(_MARKER))


def _start(tmp_path, tmp, env=None) -> subprocess.Popen:
    rank = tmp_path / "rank.py"
    rank.write_text(_RANK)
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(rank)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env or _env(tmp),
                            start_new_session=True)
    assert [proc.stdout.readline().strip() for _ in range(2)] == ["started", "started"]
    return proc


def _stop(proc: subprocess.Popen) -> str:
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    return err


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_sigkilled_launchers_marker_is_removed_by_the_next_launch(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start(tmp_path, tmp)
    try:
        proc.kill()  # its process guard stops torchrun's agent and the ranks, which say so: their marker stays
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not _markers(tmp) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    leftover = _markers(tmp)
    assert len(leftover) == 1, os.listdir(tmp)  # what the SIGKILLed launcher could not remove
    time.sleep(5)  # the killed launch's ranks are gone (its guard's grace)
    err = _stop(_start(tmp_path, tmp))
    assert [line for line in err.splitlines() if line.startswith("train: ")] == ["train: terminated"], err[-3000:]
    assert _markers(tmp) == [], os.listdir(tmp)


def test_a_leftover_marker_is_removed_but_a_live_launchers_is_kept(tmp_path):
    """A marker named for a process that is gone is removed; one of a live process, fresh, is not (it may be
    that launcher's, its ranks saying their stop right now)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gone = tmp / f"{_MARKER}{_dead_pid()}-0123abcd"
    live = tmp / f"{_MARKER}{os.getpid()}-4567cdef"
    gone.touch()
    live.touch()
    err = _stop(_start(tmp_path, tmp))
    assert [line for line in err.splitlines() if line.startswith("train: ")] == ["train: terminated"], err[-3000:]
    assert _markers(tmp) == [live.name], os.listdir(tmp)


def test_a_marker_inherited_from_a_launcher_that_is_gone_does_not_silence_the_next_one(tmp_path):
    """A shell whose environment still names a gone launcher's marker (EAGLENEST_STOP_SAID, copied from a
    rank's environment): the launch started from it took itself for a rank, so its ranks marked the gone
    launcher's file and the launcher said the stop a second time under theirs; the file stayed."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stale = tmp / f"{_MARKER}{_dead_pid()}-89abcdef"
    err = _stop(_start(tmp_path, tmp, env={**_env(tmp), "EAGLENEST_STOP_SAID": str(stale)}))
    assert [line for line in err.splitlines() if line.startswith("train: ")] == ["train: terminated"], err[-3000:]
    assert _markers(tmp) == [], os.listdir(tmp)
