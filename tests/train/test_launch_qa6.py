"""``train launch`` and direct torchrun, fifth QA pass: a rendezvous store that cannot be reached is one
line (not torchrun's C++ stack per try before it), a refusal every rank raises is printed once, and a
finished rank's gloo barrier outlives the process group (a late gloo worker aborted the rank at exit)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.pipeline import train_cli

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    return env


def test_unreachable_rendezvous_store_is_one_line(tmp_path):
    """Node 1 of two, node 0 never started: torch's C++ TCPStore logged each failed try with its C++
    stack ("Exception raised from throwTimeoutError ... frame #0: ...") before our one line."""
    endpoint = f"127.0.0.1:{_free_port()}"
    argv = ["launch", "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-timeout", "1", "--recipe", RECIPE, f"run.workdir={tmp_path / 'work'}"]
    proc = subprocess.run([sys.executable, "-m", "eaglenest.pipeline.train_cli", *argv], capture_output=True,
                          text=True, timeout=180, env=_env())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"train: error: --rdzv-endpoint {endpoint}: cannot host or reach the rendezvous store")


def test_quiet_torch_import_leaves_the_ranks_environment_as_it_was(monkeypatch):
    """The C++ log level is lowered for torchrun's own import only: the ranks inherit its environment."""
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    train_cli.import_torch_quietly()
    assert "TORCH_CPP_LOG_LEVEL" not in os.environ
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # the user's choice stands
    train_cli.import_torch_quietly()
    assert os.environ["TORCH_CPP_LOG_LEVEL"] == "INFO"


def _as_rank(monkeypatch, attempt: Path, rank: int) -> None:
    """This process as torchrun's rank ``rank`` of two on one node, in torchrun's ``attempt`` folder."""
    (attempt / str(rank)).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / str(rank) / "error.json"))


def test_refusal_of_every_rank_is_printed_once_per_attempt(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank refuses the same recipe: the line was printed once per rank."""
    bad = ["run", "--recipe", RECIPE, "train.state.resume=maybe", f"run.workdir={tmp_path / 'work'}"]
    _as_rank(monkeypatch, tmp_path / "attempt_0", 0)
    assert train_cli.main(bad) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("train: error: ") and "train.state.resume" in said[0]
    _as_rank(monkeypatch, tmp_path / "attempt_0", 1)
    assert train_cli.main(bad) == 2  # the same code, nothing said
    assert capsys.readouterr().err == ""
    # Another line (a file only this rank read) is said; so is the same line in torchrun's next attempt.
    assert train_cli.main([*bad[:3], "train.state.resume=sometimes", bad[4]]) == 2
    other = capsys.readouterr().err.strip().splitlines()
    assert len(other) == 1 and "train.state.resume" in other[0] and "sometimes" in other[0]
    _as_rank(monkeypatch, tmp_path / "attempt_1", 1)
    assert train_cli.main(bad) == 2
    assert capsys.readouterr().err.strip().splitlines() == said


def test_refusal_without_torchrun_is_always_printed(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    bad = ["run", "--recipe", RECIPE, "train.state.resume=maybe", f"run.workdir={tmp_path / 'work'}"]
    for _ in range(2):
        assert train_cli.main(bad) == 2
        assert "train.state.resume" in capsys.readouterr().err
    # An error file of the user's own, not in torchrun's attempt_<n>/<local rank>/ folders: no marker beside it.
    (tmp_path / "logs").mkdir()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "logs" / "error.json"))
    for _ in range(2):
        assert train_cli.main(bad) == 2
        assert "train.state.resume" in capsys.readouterr().err
    assert list((tmp_path / "logs").iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


@pytest.mark.slow
def test_two_ranks_refusing_the_same_table_print_one_line(tmp_path, feature_store, tiny_target):
    """`train launch --nproc 2` on a table version the store lacks: both ranks refused, two lines."""
    argv = ["launch", "--nproc", "2", "--recipe", RECIPE, f"run.workdir={tmp_path / 'work'}",
            f"run.store={feature_store[0]}", f"run.target={tiny_target}", "train.table_version=999"]
    proc = subprocess.run([sys.executable, "-m", "eaglenest.pipeline.train_cli", *argv], capture_output=True,
                          text=True, timeout=300, env=_env())
    errors = [x for x in proc.stderr.splitlines() if x.startswith("train: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "has no version 999" in errors[0], proc.stderr[-3000:]


_BARRIER_HELD = """
import sys

from eaglenest.train import dist as D
d = D.DistState.from_env()
d.barrier()
d.close()
held = D._last_barrier
assert len(held) == 1 and held[0].is_completed(), held
sys.stdout.write(f"held {d.rank}\\n")  # one write: the two ranks share the pipe (print writes in pieces)
sys.stdout.flush()
"""


@pytest.mark.slow
def test_last_barrier_outlives_the_process_group(tmp_path):
    """A rank died with "terminate called without an active exception" (SIGABRT) after a finished run:
    gloo's worker thread freed the final barrier (and the all-gathers it holds, whose tensors' Python
    objects the main thread had released) after the interpreter began finalizing, and the GIL it took
    for them ended the thread inside a C++ destructor (reproduced with gloo's workers at SCHED_IDLE on
    one CPU: 4 of 7 two-rank runs). The barrier's work is now kept until the module is torn down."""
    script = tmp_path / "barrier.py"
    script.write_text(_BARRIER_HELD)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(x for x in proc.stdout.splitlines() if x.startswith("held")) == ["held 0", "held 1"], proc.stdout


#: A run long enough to be stopped mid-way (the toy trajectory of test_distributed.py, many steps).
_LONG = ["train.draft_vocab_size=512", "train.ttt_steps=3", "train.pack_tokens=96", "train.batch_rows=3",
         "train.num_epochs=1000", "train.num_steps=5000", "train.num_threads=1", "train.state.every_steps=3"]


@pytest.mark.slow
def test_sigterm_to_train_launch_lets_torchrun_stop_its_ranks(tmp_path, feature_store, tiny_target):
    """SIGTERM (or Ctrl-C) to `train launch` mid-run: subprocess.call killed torchrun at once (SIGKILL),
    so its rank was left running until the process guard ended it ("eaglenest.reaper: ... left N
    process(es) behind") or killed with it, skipping its cleanup (a stream source's engines, the
    tracker). Now torchrun is sent SIGTERM and stops its rank, which unwinds as a stopped command does;
    the launcher ends by the signal and the saved state is whole."""
    work = tmp_path / "work"
    argv = ["launch", "--nproc", "1", "--recipe", RECIPE, f"run.workdir={work}", f"run.store={feature_store[0]}",
            f"run.target={tiny_target}", *_LONG]
    log = tmp_path / "launch.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "eaglenest.pipeline.train_cli", *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    latest = work / "train" / "state" / "latest.json"
    try:
        deadline = time.monotonic() + 240
        while not (latest.is_file() and json.loads(latest.read_text())["step"] >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == -signal.SIGTERM, text[-3000:]
    assert "behind" not in text, text[-3000:]  # the process guard had nothing left to end
    # The rank ended through its own cleanup (its "terminated" line), not by SIGKILL; the launcher, whose
    # rank said it, does not say it again (eaglenest.launch.STOP_SAID_ENV).
    assert text.count("train: terminated") == 1, text[-3000:]
    assert json.loads(latest.read_text())["step"] >= 3
