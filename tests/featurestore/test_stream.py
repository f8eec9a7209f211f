"""The streaming bypass with real vLLM engines: the table's batches, bounded in flight, clean shutdown.

One engine start per test (the stream's), besides the table capture shared with
test_stream_xhost.py (``conftest.stream_store``).
"""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from stream_helpers import FS

from eaglenest.engine import ENGINE_STOP_GRACE_S, EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore.table import store

# Kills engines and bounds how soon the other side fails: run alone, not beside other tests.
pytestmark = pytest.mark.serial

def test_channel_frames_order_credits_and_dead_producer(tmp_path):
    """Publisher -> Channel without an engine: every dtype bit-exact, handed out in tag order, at
    most ``depth`` sent ahead of the consumer, and a failing liveness check ends a wait."""
    from eaglenest.featurestore.capture.publish import Publisher
    from eaglenest.featurestore.stream.local import Channel

    xs = [torch.randn(5 + i, 4, 16).to(dt) for i, dt in
          enumerate([torch.bfloat16, torch.float32, torch.float16, torch.float32, torch.bfloat16])]
    chan = Channel(str(tmp_path / "c.sock"), num_items=len(xs), depth=2, check=lambda: None, poll_s=0.05)

    def publish():
        pub = Publisher(chan.path)
        for tag in (1, 0, 3, 2, 4):  # out of order, as a batched engine may finish them
            pub.publish(tag, torch.arange(5 + tag), xs[tag])

    threading.Thread(target=publish, daemon=True).start()
    for i in range(len(xs)):
        time.sleep(0.1)  # slow consumer
        ids, hidden = chan.next()
        assert hidden.dtype == xs[i].dtype and torch.equal(hidden, xs[i]) and ids.tolist() == list(range(5 + i))
    assert chan.max_in_flight() == 2
    chan.close()

    def dead():
        raise StoreError("producer died")

    chan = Channel(str(tmp_path / "d.sock"), num_items=1, depth=1, check=dead, poll_s=0.05)
    with pytest.raises(StoreError, match="producer died"):
        chan.next()  # nobody connects: the wait ends on the check, not never
    chan.close()


def _group_gone(pids, timeout_s=30.0) -> bool:
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return all(p.status() == psutil.STATUS_ZOMBIE for p in alive if p.is_running())


@pytest.mark.slow
def test_stream_batches_equal_table_bounded_and_early_close(stream_store, tiny_target):
    import psutil

    from eaglenest.train.data import FeatureShards
    from eaglenest.train.stream_source import StreamShards

    kw = dict(split="train", pack_tokens=64, batch_rows=2, seed=3)
    table = FeatureShards(stream_store, version=None, **kw)
    depth = 2
    src = StreamShards(stream_store, featurestore=FS, target=str(tiny_target), depth=depth, **kw)
    assert src.meta == table.meta  # same feature set identity, computed without a table
    assert [src.plan(e) for e in (0, 1)] == [table.plan(e) for e in (0, 1)]
    assert np.array_equal(src.loss_token_counts(2048)[:2048],
                          np.bincount(np.concatenate([np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1]
                                                      for r in store.read(stream_store, store.FEATURES).to_pylist()]),
                                      minlength=2048))
    # Two epochs scheduled, one consumed: the producer is still busy when the trainer stops.
    schedule = [(e, rows) for e in (0, 1) for rows in table.plan(e)]
    src.start(schedule)
    stream = src._stream
    try:
        for epoch, rows in schedule:
            if epoch:
                break
            time.sleep(0.5)  # a slow consumer: the engine must wait, not pile captures up
            got, want = src.read(rows), table.read(rows)
            for name in ("input_ids", "loss_mask", "aux", "last_hidden", "doc_ids", "position_ids"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        # Captures sent and not yet handed out, from the producer's send times and ours: the
        # credit window was filled (backpressure did the limiting) and never exceeded.
        assert stream.max_in_flight() == depth, (stream.channel.sent_at, stream.channel.handed_at)
        proc = stream.proc
        pids = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(pids) >= 2  # the producer and its engine core
        t0 = time.monotonic()
        src.close()  # early: the rest of epoch 1 is never read
        assert proc.returncode == 0, "the producer should stop its engine and exit by itself"
        assert _group_gone(pids), "engine processes left behind"
        assert time.monotonic() - t0 < 40
    finally:
        src.close()


@pytest.mark.slow
def test_slow_consumer_gets_every_capture_to_the_end(tiny_target):
    """The stream's tail. vLLM hands a finished request's states to the connector one engine step
    after the step that finished it, so the last window's captures are published after
    ``generate()`` has returned, each waiting for a credit, and a closing engine gets a grace of
    ``ENGINE_STOP_GRACE_S`` (1 s) to finish its step. Here the consumer holds its second capture for
    longer than that: a producer that closes its engine when ``generate()`` returns loses the last capture
    ('the engine closed the connection after 3 of 4 captures'); it must wait until all are out."""
    from eaglenest.featurestore.stream.local import CaptureStream

    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, 2000, 12 + 5 * i).tolist() for i in range(4)]
    engine = EngineConfig(max_model_len=256, memory_fraction=0.1, max_num_seqs=4)
    # depth 2, window 2: captures 0 and 1 use the first credits; 2 and 3 need the credits that
    # handing out 0 and 1 returns, and 1 is handed out only after the hold.
    with CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=engine, sequences=seqs,
                       depth=2, window=2) as stream:
        got = []
        for ids, hidden in stream:
            if not got:
                time.sleep(3 * ENGINE_STOP_GRACE_S)
            got.append((ids, hidden))
        proc = stream.proc
    assert [ids.tolist() for ids, _ in got] == seqs
    assert all(h.shape[:2] == (len(s), 4) for (_, h), s in zip(got, seqs))
    assert proc.returncode == 0


@pytest.mark.slow
def test_train_from_stream_equals_table_then_producer_killed(stream_store, tiny_target, tmp_path, monkeypatch):
    import psutil

    from eaglenest.train.config import StateConfig, StreamConfig, TrainConfig
    from eaglenest.train.loop import train

    common = dict(num_epochs=2, num_steps=10, warmup_steps=1, pack_tokens=64, batch_rows=1, draft_vocab_size=256,
                  ttt_steps=2, state=StateConfig(every_steps=0), log_every_steps=1, num_threads=1,
                  stream=StreamConfig(depth=2))
    ref = train(TrainConfig(output_subdir="table", **common), store_uri=stream_store, workdir=str(tmp_path),
                target_dir=str(tiny_target), seed=0)
    ref_loss = [json.loads(x)["loss"] for x in (ref.outdir / "metrics.jsonl").read_text().splitlines()]
    metrics = tmp_path / "stream" / "metrics.jsonl"
    killed = {}
    # The consumer is held before its 5th capture until the producer is dead: >= 10 captures are
    # scheduled (10 steps of a row each), at most 2 (credits) + 2 (the engine's current window) more
    # can reach it, so the stream cannot end before the kill however fast the trainer or slow the killer. (A kill timed
    # by polling the metrics raced the trainer: ~2 steps after the 2nd line the engine has sent all.)
    from eaglenest.featurestore.stream.local import CaptureStream

    held, release, hold_at, plain_next = threading.Event(), threading.Event(), 4, CaptureStream.next

    def next_held(self):
        if self.channel.handed == hold_at and not release.is_set():
            killed["stream"] = self
            held.set()
            release.wait(600)
        return plain_next(self)

    monkeypatch.setattr(CaptureStream, "next", next_held)

    def kill_producer_after_two_steps():
        try:
            if not held.wait(600):  # the engine's start, on a loaded machine (CI runs two workers)
                return
            deadline = time.monotonic() + 240  # from the hold: the start's time is not taken from the steps'
            while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
            proc = killed["stream"].proc
            killed["pids"] = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            killed["at"] = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            release.set()

    killer = threading.Thread(target=kill_producer_after_two_steps, daemon=True)
    killer.start()
    with pytest.raises(StoreError, match=r"producer \(pid \d+\) was killed by signal 9"):
        train(TrainConfig(output_subdir="stream", source="stream", **common), store_uri=stream_store,
              workdir=str(tmp_path), target_dir=str(tiny_target), seed=0, featurestore=FS)
    killer.join(timeout=5)
    assert "pids" in killed, "the stream finished before the producer could be killed"
    assert time.monotonic() - killed["at"] < 30  # a clear error, no hang
    assert _group_gone(killed["pids"]), "the engine outlived its killed producer"
    # The steps trained from the stream before the kill are the table run's steps, bit for bit.
    got = [json.loads(x)["loss"] for x in metrics.read_text().splitlines()]
    assert len(got) >= 2 and got == ref_loss[:len(got)]
