"""The cross-host stream (gloo): M engines -> N trainer ranks, each rank its share, bounded, clean end.

Fast tests run every participant of the gloo group as a thread of this process with frames made
without an engine (``synthetic_captures``: the transport under test is real, the engine is not).
Slow tests start real processes: two ``featurestore stream-serve`` engines (real vLLM) and two
trainer ranks (this file run as a script), on loopback.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch

from eaglenest.errors import StoreError

# Kills engines and bounds how soon the other side fails: run alone, not beside other tests.
pytestmark = pytest.mark.serial


def free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def synthetic_hidden(seq, layers=3, hidden=16, dtype=torch.bfloat16) -> torch.Tensor:
    """A capture made without an engine, a function of the token ids (so a receiver can check it)."""
    g = torch.Generator().manual_seed(int(np.sum(np.asarray(seq) * np.arange(1, len(seq) + 1))) % 2**31)
    return torch.randn(len(seq), layers, hidden, generator=g).to(dtype)


@contextlib.contextmanager
def synthetic_captures(spec, sequences, *, delay_s: float = 0.0, die_after: int | None = None):
    def gen():
        for k, s in enumerate(sequences):
            if die_after is not None and k == die_after:
                import os

                os._exit(9)  # a crashed engine host
            time.sleep(delay_s)
            yield np.asarray(s, dtype=np.int64), synthetic_hidden(s)
    yield gen()


def _seqs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 2000, int(rng.integers(4, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("engines,world", [(2, 2), (1, 2), (2, 1)])
def test_shares_order_bit_exact_and_credit_bound(engines, world):
    """Every rank gets exactly its sequences, in its order, bit-exact; engines exit 0; at most
    ``depth`` captures per rank sent and not consumed under a slow consumer."""
    from eaglenest.featurestore.stream.xhost import RankStream, engines_of, ranks_of, serve

    addr, depth = free_addr(), 2
    shares = {r: _seqs(7 + r, seed=r) for r in range(world)}
    results, errors, codes = {}, [], {}

    def rank(r):
        try:
            rs = RankStream(addr, rank=r, world_size=world, num_engines=engines, spec={"k": 1}, depth=depth,
                            sequences=shares[r], steps=[i // 2 for i in range(len(shares[r]))], timeout_s=60)
            got = []
            for _ in range(len(shares[r])):
                time.sleep(0.05)  # slow consumer
                got.append(rs.next())
            results[r] = (got, rs.max_in_flight())
            rs.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def engine(e):
        try:
            codes[e] = serve(addr, e, timeout_s=60, captures=synthetic_captures)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(0,))]
    threads[0].start()
    time.sleep(0.3)  # rank 0 hosts the store
    threads += [threading.Thread(target=rank, args=(r,)) for r in range(1, world)]
    threads += [threading.Thread(target=engine, args=(e,)) for e in range(engines)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors, errors
    assert codes == {e: 0 for e in range(engines)}
    for r in range(world):
        got, in_flight = results[r]
        assert [ids.tolist() for ids, _ in got] == shares[r]
        for (ids, hidden), seq in zip(got, shares[r]):
            assert hidden.dtype == torch.bfloat16 and torch.equal(hidden, synthetic_hidden(seq))
        k = len(engines_of(r, engines, world))
        assert 1 <= in_flight <= depth and in_flight == depth // k * k
    assert all(ranks_of(e, engines, world) for e in range(engines))


# -- real processes -------------------------------------------------------------------------------

HERE = __file__


def _lockstep(out: str, rank: int, world: int, done: int, timeout_s: float = 600) -> None:
    """Wait until every other rank has read ``done`` batches or ended, as the collectives of a
    training step keep real ranks in step (without it, one rank could finish its whole share while
    the other still waits for its engine to start). A rank that failed says so at once through its
    progress file, before its (slower) close: a real rank's exit ends the collective at once too."""
    from pathlib import Path

    base = out[:-len(f"rank{rank}.json")]
    deadline = time.monotonic() + timeout_s
    for r in range(world):
        progress, final = Path(f"{base}rank{r}.json.progress"), Path(f"{base}rank{r}.json")
        while r != rank and not final.is_file() and time.monotonic() < deadline:
            if _read_progress(progress) >= done:
                break
            time.sleep(0.05)


def _read_progress(path) -> int:
    """The batches a rank says it has read (-1 before its first report)."""
    text = path.read_text().strip() if path.is_file() else ""
    return int(text) if text.isdigit() else -1


def _progress(out: str, batches: int) -> None:
    import os

    with open(out + ".progress.tmp", "w") as f:
        f.write(str(batches))
    os.replace(out + ".progress.tmp", out + ".progress")  # a reader never sees it half written


def run_rank(argv) -> int:
    """Script role ``rank``: one trainer rank of a gloo stream; its batches against the table's."""
    import json

    from eaglenest.launch import dump_stacks_on_sigusr1
    from eaglenest.train.data import FeatureShards, rank_rows
    from eaglenest.train.stream_source import StreamShards
    from stream_helpers import FS

    dump_stacks_on_sigusr1()  # as in every eaglenest command: the test asks a stuck rank where it is
    uri, target, addr, rank, world, engines, out, sleep_s = argv
    rank, world, engines, sleep_s = int(rank), int(world), int(engines), float(sleep_s)
    kw = dict(split="train", pack_tokens=64, batch_rows=2, seed=3)
    table = FeatureShards(uri, version=None, **kw)
    # A generous timeout: two vLLM engines starting at once on a loaded 2-core machine took > 120 s.
    src = StreamShards(uri, featurestore=FS, target=target, depth=1, transport="gloo", engines=engines, addr=addr,
                       timeout_s=600, **kw)
    schedule = [(0, rows) for rows in table.plan(0)]
    report = {"batches": 0, "ghosts": 0, "equal": True}
    t0 = time.monotonic()
    try:
        src.start(schedule, world_size=world, rank=rank)
        for _, rows in schedule:
            mine, ghost = rank_rows(rows, rank, world)
            got, want = src.read(mine), table.read(mine)
            names = ("input_ids", "loss_mask", "doc_ids", "position_ids") if ghost else \
                ("input_ids", "loss_mask", "aux", "last_hidden", "doc_ids", "position_ids")
            for name in names:
                a, b = getattr(got, name), getattr(want, name)
                report["equal"] &= a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if ghost:
                report["equal"] &= not got.aux.any() and not got.last_hidden.any()
            report["batches"] += 1
            report["ghosts"] += int(ghost)
            _progress(out, report["batches"])
            time.sleep(sleep_s)
            _lockstep(out, rank, world, report["batches"])
        report["max_in_flight"] = src._stream.max_in_flight()
    except StoreError as exc:
        report["error"], report["error_after_s"] = str(exc), time.monotonic() - t0
        _progress(out, 10**9)  # ended: the other ranks stop waiting in _lockstep
    finally:
        report["t_end"] = time.time()
        src.close()
        table.close()
    with open(out, "w") as f:
        json.dump(report, f)
    return 3 if "error" in report else 0


def run_synthetic(argv) -> int:
    """Script roles ``synth-rank`` / ``synth-engine``: the transport between processes, no engine."""
    from eaglenest.featurestore.stream.xhost import RankStream, serve

    role, addr, who = argv[0], argv[1], int(argv[2])
    if role == "synth-engine":
        try:
            return serve(addr, who, timeout_s=60, captures=synthetic_captures)
        except StoreError as exc:
            print(f"ENGINE-ERROR {exc}", flush=True)
            return 2
    seqs = _seqs(40, seed=who)
    rs = RankStream(addr, rank=who, world_size=2, num_engines=2, spec={}, sequences=seqs, steps=list(range(40)),
                    depth=2, timeout_s=60)
    try:
        for k in range(40):
            rs.next()
            if k == 1:
                print("RANK-STARTED", flush=True)
            time.sleep(0.2)
    except StoreError as exc:
        print(f"RANK-ERROR {exc}", flush=True)
        return 3
    finally:
        rs.close()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    role = sys.argv[1]
    raise SystemExit(run_rank(sys.argv[2:]) if role == "rank" else run_synthetic(sys.argv[1:]))


def _start(args, log_path, **kw):
    import os
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as f:
        return subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env, **kw)


def _wait_for(path, text, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def _wait_progress(path, batches, timeout_s):
    """Wait until a rank's progress file says it has read at least ``batches`` batches."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _read_progress(path) >= batches:
            return True
        time.sleep(0.05)
    return False


def _exits(procs, logs, timeout_s):
    """Every process's exit code within ``timeout_s`` (all together). A process still running then
    fails the test with each one's Python stacks (SIGUSR1: faulthandler) and log tail."""
    import signal
    import subprocess

    deadline = time.monotonic() + timeout_s
    try:
        return {n: p.wait(timeout=max(0.1, deadline - time.monotonic())) for n, p in procs.items()}
    except subprocess.TimeoutExpired:
        stuck = [n for n, p in procs.items() if p.poll() is None]
        for n in stuck:
            procs[n].send_signal(signal.SIGUSR1)
        time.sleep(2.0)
        pytest.fail(f"{stuck} still running {timeout_s:.0f} s on:\n"
                    + "\n".join(f"--- {n} ---\n{logs[n].read_text()[-6000:]}" for n in logs))


def _descendants(pid):
    import psutil

    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return [pid]


def _all_gone(pids, timeout_s):
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_an_engine_waits_for_the_store_then_fails_in_one_line():
    """An engine host started before the trainer's rank 0 waits for its store; a dead address is
    one error line, without the C++ frames a TCPStore client logs when it never connects."""
    import subprocess
    from eaglenest.featurestore.stream.xhost import Group

    addr = free_addr()
    host, port = addr.rsplit(":", 1)
    late = threading.Timer(0.8, lambda: masters.append(torch.distributed.TCPStore(
        host, int(port), is_master=True, wait_for_workers=False)))
    masters: list = []
    late.start()
    t0 = time.monotonic()
    g = Group(addr, is_master=False, timeout_s=20, who="engine 0")
    late.join()
    assert masters and 0.7 < time.monotonic() - t0 < 10
    masters[0].set("k", "v")
    assert g.get("k") == b"v"
    dead = free_addr()
    with pytest.raises(StoreError, match=f"cannot reach the stream store at {dead}: nothing listens"):
        Group(dead, is_master=False, timeout_s=0.5, who="engine 0")
    p = subprocess.run([sys.executable, "-m", "eaglenest.featurestore.cli", "stream-serve", "--addr", dead,
                        "--engine-rank", "0", "--timeout-s", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "frame #" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("featurestore: error: capture stream (engine 0): cannot reach")


@pytest.mark.slow
def test_killed_rank_ends_engines_and_other_rank(tmp_path, victim=0):
    """SIGKILL of trainer rank 0 (it hosts the store) mid-stream: both engines and the other rank
    exit within seconds with a StoreError naming what was lost; nothing waits for a timeout. (A dead
    engine, with real vLLM below, covers the abort flag passed on through a live store.)"""
    import os
    import signal

    addr = free_addr()
    logs = {n: tmp_path / f"{n}.log" for n in ("rank0", "rank1", "engine0", "engine1")}
    procs = {"rank0": _start([HERE, "synth-rank", addr, "0"], logs["rank0"])}
    time.sleep(0.5)
    procs["rank1"] = _start([HERE, "synth-rank", addr, "1"], logs["rank1"])
    for e in (0, 1):
        procs[f"engine{e}"] = _start([HERE, "synth-engine", addr, str(e)], logs[f"engine{e}"])
    try:
        assert _wait_for(logs[f"rank{victim}"], "RANK-STARTED", 60), logs[f"rank{victim}"].read_text()
        os.kill(procs[f"rank{victim}"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = _exits(procs, logs, 30)
        assert time.monotonic() - t0 < 15, "a peer waited for a timeout instead of failing at once"
        other = f"rank{1 - victim}"
        assert codes == {f"rank{victim}": -9, other: 3, "engine0": 2, "engine1": 2}, \
            {n: logs[n].read_text()[-400:] for n in logs}
        # The engine linked to the victim learns it either from a failed send ("lost trainer rank 0")
        # or from the store rank 0 hosted being gone, whichever comes first: both name the rank.
        assert f"trainer rank {victim}" in logs[f"engine{victim}"].read_text()
        assert "capture stream aborted" in logs[other].read_text() or "is gone" in logs[other].read_text()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


def _stream_job(tmp_path, stream_store, tiny_target, *, sleep_s):
    addr = free_addr()
    procs, logs = {}, {}
    for r in (0, 1):
        logs[f"rank{r}"] = tmp_path / f"rank{r}.log"
        procs[f"rank{r}"] = _start([HERE, "rank", stream_store, str(tiny_target), addr, str(r), "2", "2",
                                    str(tmp_path / f"rank{r}.json"), str(sleep_s)], logs[f"rank{r}"])
        time.sleep(0.5 if r == 0 else 0)
    for e in (0, 1):
        logs[f"engine{e}"] = tmp_path / f"engine{e}.log"
        procs[f"engine{e}"] = _start(["-m", "eaglenest.featurestore.cli", "stream-serve", "--addr", addr,
                                      "--engine-rank", str(e), "--timeout-s", "600"], logs[f"engine{e}"])
    return procs, logs


@pytest.mark.slow
def test_two_engines_two_ranks_equal_table_batches_clean_end(stream_store, tiny_target, tmp_path):
    import json

    procs, logs = _stream_job(tmp_path, stream_store, tiny_target, sleep_s=0.0)
    try:
        codes = _exits(procs, logs, 600)
        assert codes == dict.fromkeys(procs, 0), {n: logs[n].read_text()[-1500:] for n in logs}
        reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        for rep in reports:
            assert rep["equal"] and rep["batches"] >= 2 and "error" not in rep, rep
            assert 1 <= rep["max_in_flight"] <= 1  # train.stream.depth=1 per rank
        assert _all_gone([p.pid for p in procs.values()], 5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
def test_killed_engine_fails_both_ranks_quickly(stream_store, tiny_target, tmp_path):
    import json
    import os
    import signal

    procs, logs = _stream_job(tmp_path, stream_store, tiny_target, sleep_s=2.0)
    try:
        for r in (0, 1):  # both ranks streaming: what follows measures failure, not an engine's start
            assert _wait_progress(tmp_path / f"rank{r}.json.progress", 1, 600), \
                {n: logs[n].read_text()[-1500:] for n in logs}
        pids = _descendants(procs["engine0"].pid)
        assert len(pids) >= 3  # stream-serve, its producer, the vLLM engine core
        os.kill(procs["engine0"].pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = _exits(procs, logs, 60)
        assert time.monotonic() - t0 < 30
        # Engine 1 either sees the abort (exit 2) or has sent rank 1 its whole share and is released
        # by rank 1's end-of-stream (exit 0): which comes first is a race; neither may hang.
        assert {k: v for k, v in codes.items() if k != "engine1"} == {"rank0": 3, "rank1": 3, "engine0": -9} \
            and codes["engine1"] in (0, 2), {n: logs[n].read_text()[-1500:] for n in logs}
        r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
        assert "rank 0 lost engine 0" in r0["error"], r0
        assert "capture stream aborted (rank 1)" in r1["error"] and "lost engine 0" in r1["error"], r1
        assert r0["t_end"] - (time.time() - (time.monotonic() - t0)) < 10  # failed within seconds of the kill
        if codes["engine1"] == 2:
            assert "capture stream aborted (engine 1)" in logs["engine1"].read_text()
        assert _all_gone(pids, 30), "the killed engine's vLLM processes outlived it"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
