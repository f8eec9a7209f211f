"""A server that ends before ``serve up`` stops it is exit 2 and one line with its exit code: within
``--for-seconds N`` (it ended with exit 0: a script that serves for a while and then checks the exit status
was told all went well), and when another process stopped it (vLLM's own exit code is then 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.mark.slow
@pytest.mark.parametrize("extra, sig, code", [
    # --for-seconds: the death is noticed at once, not at the end of the N seconds.
    (["--for-seconds", "600"], signal.SIGKILL, -signal.SIGKILL),
    # vLLM's server ends with code 0 on a SIGTERM of its own (an admin's ``kill``, a scheduler's): ``serve up``
    # ended with exit 0 and no word, as after Ctrl-C, though nothing served any more.
    ([], signal.SIGTERM, 0),
], ids=["killed-within-for-seconds", "stopped-by-someone-else"])
def test_a_server_that_ends_on_its_own_is_exit_2(tmp_path, root, tiny_target, extra, sig, code):
    argv = [sys.executable, "-m", "eaglenest.serve.cli", "up", "--no-spec", *extra,
            f"run.workdir={tmp_path / 'w'}", f"run.target={tiny_target}", "serve.max_model_len=256", "serve.port=0"]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server answers
        assert line.startswith("serving "), (line, proc.stderr.read() if proc.poll() is not None else "")
        servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
        assert len(servers) == 1, servers
        started = time.monotonic()
        os.kill(servers[0].pid, sig)
        assert proc.wait(timeout=120) == 2
        assert time.monotonic() - started < 60
        last = proc.stderr.read().strip().splitlines()[-1]
        assert last.startswith(f"serve: error: server exited with code {code}"), last
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
