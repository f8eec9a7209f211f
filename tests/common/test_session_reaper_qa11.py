"""The test session's process guard (hostile pass 11): a child a test starts the way ``openai_server`` starts
vLLM's server (``subprocess.Popen(..., start_new_session=True)``: its own session, so no process-group kill of
pytest reaches it) ends with the pytest process when the test fails without stopping it, or when the session
dies with the test (pytest-timeout's thread method ends the process at once, no fixture cleanup runs). One
such orphan vLLM server held its memory until the machine ran out of it.

Each case runs a short inner pytest session with this suite's ``tests/conftest.py`` as its plugin (no engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

INNER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path

    def test_starts_a_server_and_never_stops_it():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the child's pid and start time, read here while it surely runs (the watcher may look only after the
        # session ended it), written whole (renamed into place)
        start = Path(f"/proc/{proc.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[19].decode()
        tmp = Path(os.environ["CHILD_PID_FILE"] + ".tmp")
        tmp.write_text(f"{proc.pid} {start}")
        tmp.rename(os.environ["CHILD_PID_FILE"])
        if os.environ["HOW"] == "hangs":
            time.sleep(600)  # until pytest-timeout ends the session
        assert False, "the test fails with its server still running"
""")


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks), None when it is gone or a zombie (nothing left running)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


@pytest.mark.parametrize("how", ["fails", "hangs"])
def test_a_child_a_failed_test_left_running_ends_with_the_session(tmp_path, how):
    (tmp_path / "test_inner.py").write_text(INNER)
    pid_file = tmp_path / "child.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "CHILD_PID_FILE": str(pid_file), "HOW": how}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--timeout=5", "--timeout-method=thread", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")]
    inner = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    child = start = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() and time.monotonic() < deadline and inner.poll() is None:
            time.sleep(0.05)
        assert pid_file.is_file(), "the inner test did not start its child"
        child, start = (int(x) for x in pid_file.read_text().split())
        out, _ = inner.communicate(timeout=120)  # the watchdog keeps the pipe open until it is done
        # the inner session ended the way the case says: its assert failed, or pytest-timeout stopped it
        assert inner.returncode != 0, out[-2000:]
        if how == "fails":
            assert "1 failed" in out and "the test fails with its server still running" in out, out[-2000:]
        else:
            assert "Timeout" in out and "1 failed" not in out, out[-2000:]
        deadline = time.monotonic() + 15
        while _start_time(child) == start and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _start_time(child) != start, f"the child {child} outlived its pytest session:\n{out[-2000:]}"
        assert "eaglenest.reaper: pid " in out and "left 1 process(es) behind; ended python" in out, out[-2000:]
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        if child is not None and start is not None and _start_time(child) == start:
            os.kill(child, signal.SIGKILL)  # test hygiene without the guard: no orphan from this test either
