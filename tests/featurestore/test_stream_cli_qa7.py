"""Hostile use of the streaming bypass from its command line and its processes (QA pass 7): a
stream-serve stopped mid-stream, a store address held by another kind of service, a producer that
dies (the error says why, not only where its log is), and an engine host whose model differs from
the trainer's in dtype or vocabulary though not in shape. Every wait here has a hard bound; no
engine starts."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.stream import hostcheck, local
from eaglenest.featurestore.stream.local import CaptureStream
from eaglenest.featurestore.stream.xhost import PROTOCOL, RankStream, serve
from eaglenest.launch import Terminated

pytestmark = pytest.mark.timeout(180)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _stopped_after_one(stop: BaseException):
    """Captures made without an engine that stop (Ctrl-C, SIGTERM raised in the main thread) after the first."""
    @contextlib.contextmanager
    def captures(spec, sequences):
        def gen():
            for k, s in enumerate(sequences):
                if k == 1:
                    raise stop
                yield np.asarray(s, dtype=np.int64), torch.zeros(len(s), 2, 8, dtype=torch.bfloat16)
        yield gen()
    return captures


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), Terminated()], ids=["sigint", "sigterm"])
def test_a_stream_serve_stopped_mid_stream_ends_by_its_signal_and_tells_the_ranks(stop):
    """Ctrl-C or SIGTERM of `featurestore stream-serve` mid-stream was turned into a StoreError: the
    command exited 2 with 'error: capture stream: engine 0: KeyboardInterrupt: ' (or 'Terminated: 15')
    instead of ending by its signal, and the trainer rank read that text as the abort's reason."""
    addr, seqs = _free_addr(), [[3 + i] * (4 + i) for i in range(4)]
    out: dict = {}

    def engine():
        try:
            out["returned"] = serve(addr, 0, timeout_s=8, captures=_stopped_after_one(stop))
        except BaseException as exc:  # noqa: BLE001 - inspected below
            out["raised"] = type(exc)  # not the exception: its frames would keep the engine's gloo group open

    def start_engine():
        time.sleep(0.5)  # rank 0 hosts the store
        worker.start()

    worker = threading.Thread(target=engine, daemon=True)
    threading.Thread(target=start_engine, daemon=True).start()
    # timeout_s bounds the rank's wait for its receiver at close: in one process the stopped engine's
    # gloo pair stays open (a stream-serve that ends closes it at once)
    rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec={}, sequences=seqs, steps=[0, 0, 1, 1],
                    depth=2, timeout_s=8)
    got = []
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            for _ in seqs:  # the first capture may come out before the abort is read, or not
                got.append(rs.next()[0].tolist())
        assert time.monotonic() - t0 < 15 and got in ([], seqs[:1])
    finally:
        rs.close()
    worker.join(30)
    assert not worker.is_alive()
    assert out.get("raised") is type(stop), out  # the CLI then ends by that signal (eaglenest.launch)
    assert str(info.value) == "capture stream aborted (rank 0): engine 0: stream-serve was stopped (interrupted or " \
                              "terminated) after 1 capture", str(info.value)


def test_stream_serve_at_a_port_of_another_service_is_one_line(dropping_listener):
    """`stream-serve --addr` at a port where something else listens (it accepts and hangs up): the
    TCPStore client logged each retry's C++ stack (about 50 lines of 'frame #N') before the one
    error line."""
    p = subprocess.run([sys.executable, "-m", "eaglenest.featurestore.cli", "stream-serve", "--addr",
                        dropping_listener, "--engine-rank", "0", "--timeout-s", "2"],
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"featurestore: error: capture stream (engine 0): cannot reach the stream store at "
                               f"{dropping_listener}: "), lines


def test_a_producer_that_dies_says_why_not_only_where_its_log_is(short_tmp):
    """The trainer's error named the producer's log file and nothing of what it said: on a cluster the
    temp folder is on another machine's disk, or gone with the job. Now the line quotes the log's last
    error line, and still names the file."""
    missing = short_tmp / "no-such-target"
    with CaptureStream(str(missing), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(), sequences=[[5, 6]],
                       poll_s=0.1) as stream:
        with pytest.raises(StoreError) as info:
            stream.next()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("capture stream: the producer (pid "), msg
    said, log = msg.split(" exited with code 1 after 0 of 1 captures: ", 1)[1].rsplit("; its log: ", 1)
    assert "no-such-target" in said and said in open(log).read(), msg


def test_the_quoted_line_is_the_producers_last_error_without_its_logging_prefix(tmp_path):
    """The producer logs its own failures ('... ERROR eaglenest.featurestore.stream.producer: capture stream:
    the capture engine died ...'): the line quoted is that message, not the time stamp and logger name."""
    log = tmp_path / "producer.log"
    log.write_text("INFO 12-07 10:12:00 [core.py:1] starting\n"
                   "2026-12-07 10:12:01,893 ERROR eaglenest.featurestore.stream.producer: capture stream: the "
                   "capture engine died (its EngineCore exited: out of memory?)\n"
                   "2026-12-07 10:12:02,001 INFO eaglenest.featurestore.stream.producer: closing\n")
    said = "capture stream: the capture engine died (its EngineCore exited: out of memory?)"
    assert local._last_line(str(log)) == said
    log.write_text("")
    assert local._last_line(str(log)) == "(its log is empty)"


def _spec(target: str, **extra) -> dict:
    return {"target": target, "layer_ids": [1, 3, 5], "num_layers": 8, "hidden_size": 128, "engine": {}, **extra}


@pytest.fixture
def retyped_target(tmp_path, tiny_target):
    """The tiny target's files with another dtype and vocabulary size in config.json (weights linked)."""
    def make(**changes):
        dst = tmp_path / "_".join(f"{k}-{v}" for k, v in changes.items())
        shutil.copytree(tiny_target, dst, ignore=shutil.ignore_patterns("model.safetensors"))
        (dst / "model.safetensors").symlink_to(tiny_target / "model.safetensors")
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(changes)
        (dst / "config.json").write_text(json.dumps(cfg))
        return str(dst)
    return make


def test_stream_serve_refuses_a_model_of_another_dtype_or_vocabulary(tiny_target, retyped_target):
    """Only the layer count and width were compared: a bf16 copy of an fp32 trainer's target streamed
    states of another precision than the trainer's features (silently), and a model of another
    vocabulary of the same shape ran the trainer's token ids through another embedding."""
    want = hostcheck.target_facts(str(tiny_target))
    spec = _spec(str(tiny_target), dtype=want["dtype"], vocab_size=want["vocab_size"])
    hostcheck.check_same_shape(str(tiny_target), spec, given=True)  # the trainer's own model passes
    other_dtype = "bfloat16" if want["dtype"] != "bfloat16" else "float32"
    bf16 = retyped_target(torch_dtype=other_dtype, dtype=other_dtype)
    with pytest.raises(ConfigError) as info:
        hostcheck.check_same_shape(bf16, spec, given=True)
    assert str(info.value) == (f"--target {bf16}: dtype {other_dtype}, but the trainer's model has dtype "
                               f"{want['dtype']}: give stream-serve the trainer's model (--target DIR)")
    # the engine's dtype, when the trainer sets one, is what runs: the checkpoint's does not matter then
    hostcheck.check_same_shape(bf16, {**spec, "engine": {"dtype": want["dtype"]}}, given=True)
    wider = retyped_target(vocab_size=int(want["vocab_size"]) + 64)
    with pytest.raises(ConfigError, match=rf"vocab_size {int(want['vocab_size']) + 64}, but the trainer's model "
                                          rf"has vocab_size {want['vocab_size']}: "):
        hostcheck.check_same_shape(wider, spec, given=True)


def test_a_trainers_spec_without_dtype_or_vocabulary_is_checked_as_before(tiny_target, retyped_target):
    """A trainer of an earlier eaglenest names only the shape: nothing more is asked of the engine's model."""
    bf16 = retyped_target(torch_dtype="bfloat16", dtype="bfloat16", vocab_size=99999)
    hostcheck.check_same_shape(bf16, _spec(str(tiny_target)), given=True)


def test_serve_refuses_another_dtype_before_claiming_its_rank(tiny_target, retyped_target):
    """Through stream-serve itself: one ConfigError before this engine claims its rank or joins."""
    import torch.distributed as dist

    want = hostcheck.target_facts(str(tiny_target))
    other_dtype = "bfloat16" if want["dtype"] != "bfloat16" else "float32"
    bf16 = retyped_target(torch_dtype=other_dtype, dtype=other_dtype)
    addr = _free_addr()
    store = dist.TCPStore("127.0.0.1", int(addr.rsplit(":", 1)[1]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    store.set("spec", json.dumps({**_spec(str(tiny_target), dtype=want["dtype"], vocab_size=want["vocab_size"]),
                                  "protocol": PROTOCOL, "world_size": 1, "num_engines": 1, "depth": 2, "window": 2}))
    with pytest.raises(ConfigError, match=rf"^--target {bf16}: dtype {other_dtype}, but the trainer's model has "):
        serve(addr, 0, target=bf16, timeout_s=20)
    assert not store.check(["claim/engine-0"])
