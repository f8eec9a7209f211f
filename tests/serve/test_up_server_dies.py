"""``serve up --for-seconds N`` whose server dies before the N seconds are up ends with exit 2 and
the server's exit code, as ``serve up`` without a limit does (it ended with exit 0: a script that
serves for a while and then checks the exit status was told all went well)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.mark.slow
def test_a_server_that_dies_within_for_seconds_is_exit_2(tmp_path, root, tiny_target):
    argv = [sys.executable, "-m", "eaglenest.serve.cli", "up", "--no-spec", "--for-seconds", "600",
            f"run.workdir={tmp_path / 'w'}", f"run.target={tiny_target}", "serve.max_model_len=512", "serve.port=0"]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server answers
        assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
        servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        assert len(servers) == 1, servers
        started = time.monotonic()
        os.kill(servers[0].pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == 2
        assert time.monotonic() - started < 60  # noticed at once, not at the end of --for-seconds
        last = proc.stderr.read().strip().splitlines()[-1]
        assert last.startswith(f"serve: error: server exited with code {-signal.SIGKILL}"), last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
