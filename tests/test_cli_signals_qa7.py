"""A stopped command under torchrun (QA pass 7): SIGTERM or Ctrl-C reaches every rank of a node, and
each printed 'train: terminated' (or 'interrupted'): eight identical lines for one stop on an 8-GPU
node. Like a refusal (``eaglenest.launch.first_to_say``), the line is now said once per node and
attempt; every rank still ends by the signal. Real processes, no engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

#: A command whose body is stopped by ``SIGNAL`` (sent to itself, as torchrun or a terminal does).
_STOPPED = """
import os, signal, sys, time
from eaglenest.cli import Command, run

def body(recipe, args):
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(30)

sys.exit(run("train", "a stopped command", {"go": Command(body, "go", needs_recipe=False)}, ["go"]))
"""


def _rank(sig: str, attempt: Path | None, rank: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE")}
    if attempt is not None:
        (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   TORCHELASTIC_ERROR_FILE=str(attempt / str(rank) / "error.json"))
    return subprocess.run([sys.executable, "-c", _STOPPED, sig], capture_output=True, text=True, timeout=60,
                          env=env)


@pytest.mark.parametrize("sig, said", [("SIGTERM", "train: terminated"), ("SIGINT", "train: interrupted"),
                                       ("SIGHUP", "train: terminated (SIGHUP)")])
def test_a_stop_is_said_once_per_node_and_every_rank_ends_by_it(tmp_path, sig, said):
    procs = [_rank(sig, tmp_path / "attempt_0", r) for r in (0, 1)]
    assert [p.returncode for p in procs] == [-getattr(signal, sig)] * 2, [p.stderr for p in procs]
    lines = [line for p in procs for line in p.stderr.splitlines()]
    assert lines == [said], lines
    # torchrun's next attempt (a restart) is stopped again: said again
    again = _rank(sig, tmp_path / "attempt_1", 1)
    assert again.returncode == -getattr(signal, sig) and again.stderr.splitlines() == [said]


def test_a_stop_without_torchrun_is_always_said(tmp_path):
    for _ in range(2):
        p = _rank("SIGTERM", None, 0)
        assert p.returncode == -signal.SIGTERM and p.stderr.splitlines() == ["train: terminated"], p.stderr
    assert list(tmp_path.iterdir()) == []


#: What torchrun runs as its one rank here (the wrapper and torchrun's agent are under test, not the trainer;
#: an eaglenest rank ends by the signal with its one line, tested above).
_WORKER = ("import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
           "print('started', flush=True)\ntime.sleep(60)\n")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_torchrun_stopped_by_train_launch_ends_without_a_traceback(tmp_path, sig):
    """`train launch` stops its torchrun with SIGTERM after a Ctrl-C or SIGTERM of its own (and a Ctrl-C
    reaches torchrun directly): torchrun's agent stopped its ranks, then printed its SignalException's
    ~25-line traceback and exited 1 under the launcher's one line."""
    from eaglenest.pipeline.train_cli import _TORCHRUN

    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    proc = subprocess.Popen([sys.executable, "-c", _TORCHRUN, "--standalone", "--nproc-per-node=1",
                             "--max-restarts=0", str(worker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -getattr(signal, sig), err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
