"""A ``featurestore stream-serve`` restarted with the engine rank of one that was killed, while the
trainer ranks still wait for the stream's group to form (real processes, loopback, frames made
without an engine: the transport and the processes are real, the engine is not).

Killed before it joined the group: the restart takes its rank over and the stream runs to the end.
Killed once it had joined (the others may hold its gloo address): the restart is refused in one
line and every participant fails at once, not after ``train.stream.timeout_s``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# Kills processes and bounds how soon the others fail: run alone, not beside other tests.
pytestmark = pytest.mark.serial

TIMEOUT_S = 120  # train.stream.timeout_s of every participant: what nothing here may wait for


def _seqs(rank: int) -> list[list[int]]:
    return [[3 + rank * 50 + i] * (4 + i) for i in range(5)]


@contextlib.contextmanager
def _frames(spec, sequences):
    import torch

    yield ((np.asarray(s, dtype=np.int64), torch.zeros(len(s), 2, 8, dtype=torch.bfloat16)) for s in sequences)


def _role(argv) -> int:
    """``rank ADDR R WORLD ENGINES`` or ``engine ADDR E``: one participant, its outcome on stdout."""
    from eaglenest.errors import EaglenestError
    from eaglenest.featurestore.stream.xhost import RankStream, serve

    role, addr, who = argv[0], argv[1], int(argv[2])
    t0 = time.monotonic()
    try:
        if role == "engine":
            code = serve(addr, who, timeout_s=TIMEOUT_S, captures=_frames)
            print(f"ENGINE-EXIT {code}", flush=True)
            return code
        world, engines = int(argv[3]), int(argv[4])
        seqs = _seqs(who)
        rs = RankStream(addr, rank=who, world_size=world, num_engines=engines, spec={}, sequences=seqs,
                        steps=list(range(len(seqs))), depth=2, timeout_s=TIMEOUT_S)
        got = [rs.next()[0].tolist() for _ in seqs]
        rs.close()
        print(f"RANK-OK {got == seqs}", flush=True)
        return 0
    except EaglenestError as exc:
        print(f"ERROR after {time.monotonic() - t0:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        return 2


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def start(tmp_path):
    """``start(name, *role)``: this file run as one participant, its log in tmp_path; killed at the end."""
    procs: list[subprocess.Popen] = []

    def run(name: str, *args) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as f:
            procs.append(subprocess.Popen([sys.executable, __file__, *args], stdout=f, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        return procs[-1], log
    yield run
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _wait_for_key(addr: str, key: str, timeout_s: float = 60.0) -> None:
    """Until ``key`` is in the stream's store (read as a client, as an engine host does)."""
    import torch.distributed as dist

    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:  # rank 0 may not host its store yet
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
            break
        except RuntimeError:
            assert time.monotonic() < deadline, "trainer rank 0 hosts no store"
            time.sleep(0.2)
    store.wait([key], datetime.timedelta(seconds=timeout_s))


def _outcome(proc: subprocess.Popen, log: Path, timeout_s: float) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    return code, log.read_text()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def test_an_engine_killed_before_joining_is_taken_over_by_its_restart(start):
    """Engine 0 feeds ranks 0 and 1; killed while it waits for rank 1's share (claimed, not joined),
    then restarted: the restart was refused ('already taken' by the dead pid) and the ranks waited
    the whole timeout for a group that could not form. Now the restart runs the stream to the end."""
    addr = _free_addr()
    rank0, log0 = start("rank0", "rank", addr, "0", "2", "1")
    first, _ = start("engine-first", "engine", addr, "0")
    _wait_for_key(addr, "claim/engine-0")
    time.sleep(1.0)  # it reads its shares: rank 1's is not there yet
    assert first.poll() is None
    _kill(first)
    again, again_log = start("engine-again", "engine", addr, "0")
    rank1, log1 = start("rank1", "rank", addr, "1", "2", "1")
    t0 = time.monotonic()
    outcomes = {n: _outcome(p, lg, 60) for n, p, lg in
                (("engine", again, again_log), ("rank0", rank0, log0), ("rank1", rank1, log1))}
    assert outcomes["engine"][0] == 0 and "ENGINE-EXIT 0" in outcomes["engine"][1], outcomes["engine"][1][-2000:]
    for n in ("rank0", "rank1"):
        assert outcomes[n][0] == 0 and "RANK-OK True" in outcomes[n][1], outcomes[n][1][-2000:]
    assert time.monotonic() - t0 < TIMEOUT_S / 2


def test_an_engine_killed_after_joining_fails_its_restart_and_the_ranks_at_once(start):
    """Engine 0 of 2 joined the group (waiting for engine 1), killed, restarted: the restart is one
    line naming the dead engine, and trainer rank 0 fails at once with it instead of waiting
    train.stream.timeout_s in the group's formation."""
    addr = _free_addr()
    rank0, log0 = start("rank0", "rank", addr, "0", "1", "2")
    first, _ = start("engine-first", "engine", addr, "0")
    _wait_for_key(addr, "joined/engine-0")  # what it marks before it joins the group
    time.sleep(2.0)  # in the group's formation: gloo waits for engine 1, which never comes
    assert first.poll() is None
    _kill(first)
    again, again_log = start("engine-again", "engine", addr, "0")
    t0 = time.monotonic()
    code, text = _outcome(again, again_log, 60)
    rank_code, rank_text = _outcome(rank0, log0, 30)
    waited = time.monotonic() - t0
    assert code == 2 and "Traceback" not in text, text[-2000:]
    line = text.strip().splitlines()[-1]
    assert line.startswith("ERROR") and "engine 0" in line and "died" in line and "restart the trainer" in line, line
    assert rank_code == 2, rank_text[-2000:]
    rank_line = rank_text.strip().splitlines()[-1]
    assert "capture stream aborted (rank 0)" in rank_line and "died" in rank_line, rank_line
    assert waited < 30  # not TIMEOUT_S


if __name__ == "__main__":
    raise SystemExit(_role(sys.argv[1:]))
