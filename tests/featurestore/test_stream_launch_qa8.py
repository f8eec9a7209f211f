"""The streaming bypass's launch, hostile pass 8: a stopped ``train launch`` says its stop once (the
launcher and a rank each printed it), and a trainer rank other than 0 at a stream address where no
stream store answers ends in one line like rank 0 (it printed the TCPStore client's C++ retry stacks
first). Real processes: torchrun's agent, ranks that are eaglenest commands; no engine."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch_helpers import LAUNCHER as _LAUNCHER, RANK as _RANK  # on sys.path via conftest

pytestmark = pytest.mark.timeout(180)


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for k in ("TORCH_CPP_LOG_LEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE",
              "EAGLENEST_STOP_SAID"):
        env.pop(k, None)
    return env


@pytest.mark.parametrize("sig, said", [("SIGTERM", "train: terminated"), ("SIGINT", "train: interrupted")])
def test_a_stopped_train_launch_says_its_stop_once(tmp_path, sig, said):
    """SIGTERM to `train launch` (a scheduler's stop), or Ctrl-C to its whole process group (a terminal):
    its two ranks said the stop once between them, and the launcher said it again under theirs."""
    rank = tmp_path / "rank.py"
    rank.write_text(_RANK)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(rank)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env={**_env(), "TMPDIR": str(tmp)},
                            start_new_session=True)
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["started", "started"]
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -getattr(signal, sig), err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("train: ")]
    assert stops == [said], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    # The launcher leaves no marker of who said it behind.
    assert not [p for p in os.listdir(tmp) if p.startswith("eaglenest")], os.listdir(tmp)


def test_a_stopped_command_without_a_launcher_still_says_it_every_time(tmp_path):
    """Each of two commands run one after the other from one shell is stopped: each says so."""
    rank = tmp_path / "rank.py"
    rank.write_text(_RANK)
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=_env())
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM and err.splitlines() == ["train: terminated"], err


#: A trainer rank's stream (torch imported as a trainer does, its C++ log at the default level).
_TRAINER_RANK = """
import sys
import torch
from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.xhost import RankStream

try:
    RankStream(sys.argv[1], rank=int(sys.argv[2]), world_size=2, num_engines=1, spec={}, sequences=[[1, 2]],
               steps=[0], depth=2, timeout_s=2)
except StoreError as exc:
    print(f"train: error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_rank_at_a_store_address_of_another_service_fails_in_one_line(dropping_listener):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _TRAINER_RANK, dropping_listener, "1"], capture_output=True,
                       text=True, timeout=120, env=_env())
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"train: error: capture stream (rank 1): cannot reach the stream store at "
                               f"{dropping_listener}: "), lines
    assert time.monotonic() - t0 < 60


def test_the_cpp_log_is_quiet_only_while_the_store_client_connects(monkeypatch, dropping_listener):
    """After a rank's failed connect its C++ log is at the level it had (later warnings still show); a level
    the user set (TORCH_CPP_LOG_LEVEL) is never touched."""
    from eaglenest import launch
    from eaglenest.errors import StoreError
    from eaglenest.featurestore.stream.xhost import Group

    level = launch._cpp_log_level()
    assert level is not None
    before = level.value
    assert before != 3  # else "back at the level it had" and "never touched" below would hold whatever it does
    with launch.quiet_cpp_log():
        with launch.quiet_cpp_log():
            assert level.value == 3
        assert level.value == 3
    assert level.value == before
    with pytest.raises(StoreError, match=f"cannot reach the stream store at {dropping_listener}"):
        Group(dropping_listener, is_master=False, timeout_s=1, who="rank 1")
    assert level.value == before
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")
    with launch.quiet_cpp_log():
        assert level.value == before


def test_ranks_whose_engines_never_come_each_fail_in_one_line():
    """No `stream-serve` at train.stream.addr: rank 0 hosts the store, both ranks wait for the group, and
    each printed gloo's C++ 'waitForInput ... timed out' warnings before its one line."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-c", _TRAINER_RANK, addr, str(r)], stderr=subprocess.PIPE,
                              text=True, env=_env()) for r in (0, 1)]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"train: error: capture stream (rank {r}): the group of 3 did not form within "
                                   "2 s (train.stream.timeout_s)"), lines


def _descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    import psutil

    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_sigkilled_train_launch_leaves_no_torchrun_agent_or_rank(tmp_path):
    """SIGKILL of `train launch` (the OOM killer, `kill -9`): nothing of it can clean up, and torchrun's
    agent and its ranks, started by fork+exec, never notice their parent's death. The launcher's process
    guard ends them all within seconds."""
    rank = tmp_path / "rank.py"
    rank.write_text(_RANK)
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(rank)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(), start_new_session=True)
    kids: set[int] = set()
    try:
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["started", "started"]
        kids = _descendants(proc.pid)
        assert len(kids) >= 3  # torchrun's agent and two ranks (and their own process guards)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(kids), _alive(kids)
    finally:
        for pid in _alive(kids):
            os.kill(pid, signal.SIGKILL)


#: A trainer rank that streams its share slowly (one engine, two ranks; captures made without an engine).
_STREAMING_RANK = """
import sys, time
import torch
from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.xhost import RankStream

addr, rank = sys.argv[1], int(sys.argv[2])
seqs = [[3 + i] * (4 + i) for i in range(40)]
rs = RankStream(addr, rank=rank, world_size=2, num_engines=1, spec={}, sequences=seqs, steps=list(range(40)),
                depth=2, timeout_s=60)
try:
    for k in range(40):
        rs.next()
        if k == 1:
            print("RANK-STARTED", flush=True)
        time.sleep(0.2)
except StoreError as exc:
    print(f"train: error: {exc}", file=sys.stderr)
    sys.exit(2)
finally:
    rs.close()
"""

_SYNTHETIC_ENGINE = """
import contextlib, sys
import numpy as np, torch
from eaglenest.featurestore.stream.xhost import serve

@contextlib.contextmanager
def captures(spec, sequences):
    yield ((np.asarray(s, dtype=np.int64), torch.zeros(len(s), 2, 8, dtype=torch.bfloat16)) for s in sequences)

try:
    serve(sys.argv[1], 0, timeout_s=60, captures=captures)
except Exception:
    sys.exit(2)
"""


def test_a_rank_whose_rank_0_is_killed_mid_stream_fails_in_one_line(tmp_path):
    """SIGKILL of trainer rank 0 (it hosts the stream's store) mid-stream: rank 1 printed a C++ stack for
    each call on the store that had gone (reading the abort, writing its own, marking itself done)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    procs = {}
    try:
        procs[0] = subprocess.Popen([sys.executable, "-c", _STREAMING_RANK, addr, "0"], stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=_env())
        time.sleep(1.0)  # rank 0 hosts the store
        procs[1] = subprocess.Popen([sys.executable, "-c", _STREAMING_RANK, addr, "1"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env())
        procs["engine"] = subprocess.Popen([sys.executable, "-c", _SYNTHETIC_ENGINE, addr],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
        assert procs[0].stdout.readline().strip() == "RANK-STARTED"
        assert procs[1].stdout.readline().strip() == "RANK-STARTED"
        procs[0].kill()
        _, err = procs[1].communicate(timeout=90)
        lines = err.strip().splitlines()
        assert procs[1].returncode == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("train: error: capture stream aborted (rank 1): ") and "rank 0" in lines[0], lines
        procs["engine"].wait(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
