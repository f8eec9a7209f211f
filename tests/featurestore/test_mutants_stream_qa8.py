"""What the stream's mutation audit (QA pass 8) found untested, checked from first principles: the
schedule a rank puts in the store survives the trip bit for bit for any token id a real vocabulary
holds (ids of 150K-token vocabularies, not only the tests' ids < 2000), and the trainer's stream
source over gloo hands each rank exactly the batches an independent reference builds from the
captures (the aux layers, the last layer, the ids, the loss mask), every sample of the epoch
captured once (a ghost rank's row is not captured again). Captures are made without an engine
(the transport and the source are under test), as a function of their token ids."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from stream_helpers import FS, prompts

from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.xhost import _pack, _unpack, serve
from eaglenest.featurestore.table import store
from eaglenest.train.data import collate, rank_rows
from eaglenest.train.stream_source import StreamShards

pytestmark = pytest.mark.timeout(180)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_share_round_trips_any_token_id_a_vocabulary_holds():
    rng = np.random.default_rng(0)
    lengths = [1, 7, 0, 33, 2]  # an empty sequence too: its neighbours keep their own ids
    seqs = [rng.integers(0, 2**31 - 1, n).tolist() for n in lengths]
    seqs[1][:3] = [151_935, 2**31 - 1, 0]  # a Qwen-sized vocabulary's last id, the largest id, the smallest
    positions, steps = [0, 3, 5, 9, 12], [0, 0, 1, 7, 40_000]
    assert _unpack(_pack(positions, steps, seqs)) == (positions, steps, seqs)
    assert _unpack(_pack([], [], [])) == ([], [], [])


def _states(seq, layers: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, layers, hidden] states that differ per sample, token, layer and unit (seeded by the ids)."""
    g = torch.Generator().manual_seed(int(np.sum(np.asarray(seq) * np.arange(1, len(seq) + 1))) % 2**31)
    return torch.randn(len(seq), layers, hidden, generator=g).to(dtype)


@pytest.fixture(scope="module")
def source_store(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("stream-src") / "store")
    store.append(uri, store.PROMPTS, prompts(7))
    return uri


def _expected(src: StreamShards, rows, layers: int, hidden: int, dtype) -> object:
    """The batch of ``rows`` built from the captures without the stream: ids truncated to pack_tokens,
    the response's loss mask, aux = layers 0..L-2 flattened in (ascending) layer order, last = layer L-1."""
    out = []
    for row in rows:
        parts = []
        for i in row:
            c = src.convs[i]
            seq = c["prompt_token_ids"] + c["response_token_ids"]
            n = min(len(seq), src.pack_tokens)
            h = _states(seq, layers, hidden, dtype)[:n].float()
            parts.append((torch.tensor(seq[:n]), torch.from_numpy(src.masks[i][:n].copy()),
                          h[:, :-1].reshape(n, -1), h[:, -1]))
        out.append(parts)
    return collate(out)


def test_stream_source_batches_equal_a_reference_each_sample_captured_once(source_store, tiny_target):
    addr, world = _free_addr(), 2
    captured: list = []
    engine_out: dict = {}

    @contextlib.contextmanager
    def captures(spec, sequences):
        dtype = getattr(torch, spec["dtype"])
        layers = len(spec["layer_ids"]) + 1
        captured.extend(tuple(s) for s in sequences)
        yield ((np.asarray(s, dtype=np.int64), _states(s, layers, spec["hidden_size"], dtype)) for s in sequences)

    def engine():
        try:
            engine_out["code"] = serve(addr, 0, timeout_s=60, captures=captures)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            engine_out["error"] = repr(exc)

    srcs = [StreamShards(source_store, featurestore=FS, target=str(tiny_target), split="train", pack_tokens=48,
                         batch_rows=3, seed=0, depth=2, transport="gloo", engines=1, addr=addr, timeout_s=60)
            for _ in range(world)]
    # batch_rows 3 over two ranks: one rank has two rows, the other one; a last batch of one row leaves
    # rank 1 a ghost
    schedule = [(0, rows) for rows in srcs[0].plan(0)]
    assert any(len(rows) == 1 for _, rows in schedule) or len(schedule[-1][1]) < world
    got: dict = {}
    errors: list = []

    def rank(r):
        try:
            srcs[r].start(schedule, world_size=world, rank=r)
            got[r] = [srcs[r].read(rank_rows(rows, r, world)[0]) for _, rows in schedule]
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(repr(exc))
        finally:
            srcs[r].close()

    threads = [threading.Thread(target=rank, args=(0,), daemon=True)]
    threads[0].start()
    threading.Event().wait(0.3)  # rank 0 hosts the store
    threads += [threading.Thread(target=rank, args=(1,), daemon=True), threading.Thread(target=engine, daemon=True)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and engine_out == {"code": 0}, (errors, engine_out)
    meta = srcs[0].meta
    layers, dtype = len(meta.layer_ids) + 1, getattr(torch, meta.dtype)
    ghosts = 0
    for r in range(world):
        for (_, rows), batch in zip(schedule, got[r]):
            mine, ghost = rank_rows(rows, r, world)
            if ghost:  # the row's ids and mask, zero states: nothing captured for it
                ghosts += 1
                want = _expected(srcs[r], mine, layers, meta.hidden_size, dtype)
                assert torch.equal(batch.input_ids, want.input_ids) and not batch.aux.any() \
                    and not batch.last_hidden.any()
                continue
            want = _expected(srcs[r], mine, layers, meta.hidden_size, dtype)
            for name in ("input_ids", "loss_mask", "aux", "last_hidden", "doc_ids", "position_ids"):
                assert torch.equal(getattr(batch, name), getattr(want, name)), (r, rows, name)
    assert ghosts >= 1  # the case under test happened
    # every sample of the epoch captured exactly once, a ghost's row not again
    epoch = Counter(tuple(srcs[0].convs[i]["prompt_token_ids"] + srcs[0].convs[i]["response_token_ids"])
                    for _, rows in schedule for row in rows for i in row)
    assert Counter(captured) == epoch


def _synthetic(delay_s: float = 0.0, *, drop_last_token: bool = False):
    """Captures made without an engine: [T, 2, 8] bf16 states of each sequence, after ``delay_s`` each."""
    @contextlib.contextmanager
    def captures(spec, sequences):
        def gen():
            for s in sequences:
                threading.Event().wait(delay_s)
                s = s[:-1] if drop_last_token else s
                yield np.asarray(s, dtype=np.int64), _states(s, 2, 8, torch.bfloat16)
        yield gen()
    return captures


def _engine_thread(addr, out, engine_rank=0, timeout_s=30, **kw):
    def run():
        try:
            out[f"engine {engine_rank}"] = serve(addr, engine_rank, timeout_s=timeout_s, captures=_synthetic(**kw))
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            out[f"engine {engine_rank}"] = str(exc)
    t = threading.Thread(target=run, daemon=True)
    threading.Timer(0.4, t.start).start()  # after rank 0 hosts the store
    return t


def _wait_until(cond, timeout_s: float = 20.0) -> bool:
    deadline = threading.Event()
    t = threading.Timer(timeout_s, deadline.set)
    t.start()
    while not cond() and not deadline.is_set():
        threading.Event().wait(0.02)
    t.cancel()
    return cond()


def test_a_capture_of_another_length_than_its_sequence_is_refused():
    """An engine whose captures lack the sequence's last token (another tokenisation, a cut prompt): the
    rank refuses the first such frame naming both lengths, instead of handing out states of other tokens."""
    from eaglenest.featurestore.stream.xhost import RankStream

    addr, seqs, out = _free_addr(), [[5 + i] * (6 + i) for i in range(3)], {}
    # timeout_s bounds the engine's send of the refused frame's rest (it waited 30 s for credits that never come)
    t = _engine_thread(addr, out, drop_last_token=True, timeout_s=5)
    rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=seqs, steps=[0, 1, 2], depth=2,
                    timeout_s=30)
    try:
        with pytest.raises(StoreError, match=r"bad frame from engine 0 at position 0: 5 tokens for a sequence of 6"):
            rs.next()
    finally:
        rs.close()
    t.join(60)
    assert not t.is_alive() and str(out["engine 0"]).startswith("capture stream"), out  # the engine was told


def test_an_abort_elsewhere_ends_a_rank_whose_captures_are_already_here():
    """Another participant fails while this rank still has captures waiting: its next read fails with that
    participant's message (within a poll), it does not go on training on what had arrived."""
    from eaglenest.featurestore.stream.xhost import RankStream

    addr, seqs, out = _free_addr(), [[5 + i] * (6 + i) for i in range(8)], {}
    t = _engine_thread(addr, out)
    rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=seqs, steps=list(range(8)),
                    depth=4, timeout_s=30, poll_s=0.1)
    try:
        assert rs.next()[0].tolist() == seqs[0]
        assert _wait_until(lambda: len(rs._pending) >= 3)  # captures are here, unread
        rs.group.store.compare_set("abort", "", "rank 1: out of memory")  # what a failing participant writes
        threading.Event().wait(0.3)  # more than poll_s
        with pytest.raises(StoreError, match=r"capture stream aborted \(rank 0\): rank 1: out of memory"):
            rs.next()
    finally:
        rs.close()
    t.join(60)


def test_credits_keep_depth_captures_in_flight_while_the_consumer_pauses():
    """Flow control grants exactly ``depth``: after a few reads, a paused consumer finds ``depth`` captures
    waiting (never more), so the engine keeps computing ahead; credits granted while the engine was busy
    were not lost."""
    from eaglenest.featurestore.stream.xhost import RankStream

    depth, addr, seqs, out = 3, _free_addr(), [[5 + i] * (6 + i) for i in range(10)], {}
    t = _engine_thread(addr, out, delay_s=0.15)  # an engine slower than its consumer
    rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=seqs, steps=list(range(10)),
                    depth=depth, timeout_s=30)
    try:
        for i in range(3):  # each read as soon as its capture arrives: credits come back while the engine works
            assert rs.next()[0].tolist() == seqs[i]
        assert _wait_until(lambda: len(rs._pending) >= depth)
        threading.Event().wait(0.5)  # three engine steps more: no capture past the bound
        assert len(rs._pending) == depth
        assert [rs.next()[0].tolist() for _ in range(3, 10)] == seqs[3:]
    finally:
        t0 = time.monotonic()
        rs.close()
    t.join(60)
    assert out == {"engine 0": 0}
    # the rank's close tells its engine it is done: both leave at once, not after timeout_s (30 s here)
    assert time.monotonic() - t0 < 10


def test_an_engine_serving_two_ranks_in_lockstep_feeds_them_step_by_step():
    """One engine, two ranks that meet after every step (a training step's collectives), one capture in
    flight per rank: the engine must hand captures out by training step across its ranks; rank by rank,
    it waited for rank 0's credit while rank 0 waited for rank 1 at the step's end (a deadlock)."""
    from eaglenest.featurestore.stream.xhost import RankStream

    addr, steps, out = _free_addr(), 4, {}
    shares = {r: [[7 + r + 2 * i] * (5 + i) for i in range(2 * steps)] for r in range(2)}  # two samples a step
    barrier = threading.Barrier(2, timeout=20)
    got: dict = {}

    def rank(r):
        rs = RankStream(addr, rank=r, world_size=2, num_engines=1, spec={}, sequences=shares[r],
                        steps=[i // 2 for i in range(2 * steps)], depth=1, timeout_s=30)
        try:
            got[r] = []
            for _ in range(steps):
                got[r] += [rs.next()[0].tolist() for _ in range(2)]
                barrier.wait()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            got[r] = repr(exc)
            barrier.abort()
        finally:
            rs.close()

    threads = [threading.Thread(target=rank, args=(0,), daemon=True)]
    threads[0].start()
    threading.Event().wait(0.3)
    threads.append(threading.Thread(target=rank, args=(1,), daemon=True))
    threads[1].start()
    threads.append(_engine_thread(addr, out))
    for th in threads:
        th.join(90)
    assert got == shares and out == {"engine 0": 0}, (got, out)


def test_a_depth_below_a_ranks_engine_count_is_refused_before_the_store():
    """Each engine link needs a credit of its own: ``depth // k`` credits per link would be 0 with
    depth < k, and the engines would never send (every participant waits for train.stream.timeout_s)."""
    from eaglenest.errors import ConfigError
    from eaglenest.featurestore.stream.xhost import RankStream

    with pytest.raises(ConfigError, match=r"train.stream.depth: 1 is less than the 2 engines that feed rank 0 "
                                          r"\(train.stream.engines=2, 1 ranks\)"):
        RankStream(_free_addr(), rank=0, world_size=1, num_engines=2, spec={}, sequences=[[1, 2]], steps=[0],
                   depth=1, timeout_s=5)


def test_a_tag_published_twice_is_refused(short_tmp):
    """A capture published twice under one tag (another client on the socket, a replayed request) took
    the place of another in the count of frames: that one was never read and the consumer waited for ever."""
    from eaglenest.featurestore.capture.publish import Publisher
    from eaglenest.featurestore.stream.local import Channel

    chan = Channel(str(short_tmp / "c.sock"), num_items=3, depth=3, check=lambda: None, poll_s=0.05)

    def publish():
        pub = Publisher(chan.path)
        for tag in (0, 0, 1):
            pub.publish(tag, torch.arange(4), torch.zeros(4, 2, 8))

    threading.Thread(target=publish, daemon=True).start()
    try:
        assert chan.next()[0].tolist() == [0, 1, 2, 3]
        with pytest.raises(StoreError, match="capture stream: unexpected tag 0"):
            chan.next()
    finally:
        chan.close()


def test_one_capture_in_flight_still_reaches_the_last(short_tmp):
    """depth 1: every capture after the first waits for the credit its predecessor's hand-out grants, the
    last one included."""
    from eaglenest.featurestore.capture.publish import Publisher
    from eaglenest.featurestore.stream.local import Channel

    xs = [torch.randn(3 + i, 2, 8) for i in range(4)]
    chan = Channel(str(short_tmp / "c.sock"), num_items=len(xs), depth=1, check=lambda: None, poll_s=0.05)

    def publish():
        pub = Publisher(chan.path)
        for tag, x in enumerate(xs):
            pub.publish(tag, torch.arange(x.shape[0]), x)

    threading.Thread(target=publish, daemon=True).start()
    try:
        for x in xs:
            assert torch.equal(_next_within(chan, 20)[1], x)
        assert chan.max_in_flight() == 1
    finally:
        chan.close()


def _next_within(chan, seconds: float):
    """``chan.next()`` with a bound: its result, or an AssertionError when it hung."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(chan.next()), daemon=True)
    t.start()
    t.join(seconds)
    assert got, f"no capture within {seconds} s"
    return got[0]


#: A CLI (a real command, so its process guard runs) leaving one process behind for its guard: "orphan", a
#: fork+exec grandchild whose parent exits at once (reparented before a snapshot can see it in the tree), or
#: "stubborn", a child that ignores SIGTERM. Prints that process's pid, then waits to be killed.
_LEAVER = """
import subprocess, sys, time
from eaglenest.cli import Command, run

def body(recipe, args):
    if sys.argv[1] == "orphan":
        code = "import subprocess; print(subprocess.Popen(['sleep', '120']).pid)"
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        pid = child.stdout.readline().strip()
        child.wait()
    else:
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
                                 stdout=subprocess.PIPE, text=True)
        child.stdout.readline()
        pid = child.pid
    print(pid, flush=True)
    time.sleep(120)

sys.exit(run("qa", "leaves a process", {"go": Command(body, "go", needs_recipe=False)}, ["go"]))
"""


def _gone(pid: int, timeout_s: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        p.wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return p.status() == psutil.STATUS_ZOMBIE
    return True


@pytest.mark.parametrize("mode", ["orphan", "stubborn"])
def test_a_sigkilled_session_leader_leaves_neither_orphans_nor_stubborn_children(mode):
    """SIGKILL of a CLI that leads its own session (setsid, a launcher's start_new_session): a fork+exec
    grandchild orphaned before any snapshot saw it is ended as a member of the session, and a child that
    ignores SIGTERM is SIGKILLed after the grace period."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _LEAVER, mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    left = int(proc.stdout.readline())
    try:
        time.sleep(0.6)  # the guard has taken a snapshot or two
        proc.kill()
        proc.wait(timeout=30)
        assert _gone(left, 20), f"{mode} process {left} outlived its CLI"
    finally:
        try:
            os.kill(left, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_captures_of_other_tokens_of_the_same_length_fail_the_read(source_store, tiny_target):
    """An engine whose capture is of other token ids than the sequence sent (same length: another
    tokenisation, a stale engine host): the source refuses it naming the sample, never trains on it."""
    addr, out = _free_addr(), {}

    @contextlib.contextmanager
    def shifted(spec, sequences):
        dtype, layers = getattr(torch, spec["dtype"]), len(spec["layer_ids"]) + 1
        yield ((np.asarray(s, dtype=np.int64) + 1, _states(s, layers, spec["hidden_size"], dtype)) for s in sequences)

    def engine():
        try:
            out["code"] = serve(addr, 0, timeout_s=30, captures=shifted)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            out["error"] = str(exc)

    src = StreamShards(source_store, featurestore=FS, target=str(tiny_target), split="train", pack_tokens=48,
                       batch_rows=2, seed=0, depth=2, transport="gloo", engines=1, addr=addr, timeout_s=30)
    schedule = [(0, rows) for rows in src.plan(0)]
    t = threading.Thread(target=engine, daemon=True)
    threading.Timer(0.4, t.start).start()
    try:
        src.start(schedule, world_size=1, rank=0)
        first = schedule[0][1][0][0]
        with pytest.raises(StoreError, match=rf"token ids of {src.convs[first]['sample_id']} differ from the "
                                             "sequence sent"):
            src.read(schedule[0][1])
    finally:
        src.close()
    t.join(60)
