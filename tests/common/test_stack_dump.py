"""``kill -USR1`` makes any eaglenest command print where each of its threads is, and go on."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for ``sig`` (Linux: SigCgt in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_sigusr1_dumps_every_thread_and_the_command_goes_on(tmp_path):
    with socket.socket() as s:  # a port nobody listens on: stream-serve waits to reach the store
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "eaglenest.featurestore.cli", "stream-serve", "--addr", addr,
                              "--engine-rank", "0", "--timeout-s", "60"], stderr=f, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _catches(p.pid, signal.SIGUSR1) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None and _catches(p.pid, signal.SIGUSR1), err.read_text()[-2000:]
        p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while "most recent call first" not in err.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        text = err.read_text()
        # The main thread's stack, wherever it is now (importing torch, or waiting for the store).
        assert "most recent call first" in text and 'cli.py", line' in text, text[-2000:]
        assert p.poll() is None  # still running: the dump does not end the command
    finally:
        p.kill()
        p.wait()
