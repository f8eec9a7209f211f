"""Hostile input to the cross-host stream, without an engine: addresses no resolver takes, two trainer
processes given one rank, and a stream-serve whose model is not the trainer's. Each is one clear
ConfigError or StoreError, at once (every wait here has a hard bound)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.stream.xhost import PROTOCOL, RankStream, serve

pytestmark = pytest.mark.timeout(120)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def _frames(spec, sequences, *, layers=2, hidden=8):
    """Captures made without an engine (the transport is under test): bf16 zeros of each length."""
    yield ((np.asarray(s, dtype=np.int64), torch.zeros(len(s), layers, hidden, dtype=torch.bfloat16))
           for s in sequences)


@pytest.mark.parametrize("addr, problem", [
    ("a..b:29650", "host 'a..b' is neither an IP address nor a host name"),
    ("x" * 64 + ".example:29650", "is neither an IP address nor a host name"),
    ("hôst:29650", "host 'hôst' is neither an IP address nor a host name"),
    ("my host:29650", "host 'my host' is neither"),
    ("ho\nst:29650", "host 'ho\\nst' is neither"),
    ("::1:29650", "the IPv6 host '::1' goes in brackets ([::1]:PORT)"),
    ("[::1:29650", "host '[::1' is not an IPv6 address"),
    ("[10.0.0.5]:29650", "host '10.0.0.5' is not an IPv6 address"),
])
def test_a_host_no_resolver_takes_is_refused_naming_the_key(addr, problem):
    """Such hosts were accepted: an empty or 64-character label then raised a UnicodeError traceback
    from the resolver, and a space, a newline or a non-ASCII name was retried for the whole timeout."""
    with pytest.raises(ConfigError) as info:
        parse_addr(addr)
    assert str(info.value).startswith("train.stream.addr: ") and problem in str(info.value), str(info.value)


def test_hosts_that_are_addresses_or_names_still_pass():
    assert parse_addr("gpu-node_7.cluster.local:29650") == ("gpu-node_7.cluster.local", 29650)
    assert parse_addr("xn--hst-sna.example.:80") == ("xn--hst-sna.example.", 80)
    assert parse_addr("[fd00::5]:29650") == ("fd00::5", 29650)
    assert parse_addr("10.0.0.5:1") == ("10.0.0.5", 1)


def test_stream_serve_with_an_unencodable_host_is_one_line(capsys):
    # `featurestore stream-serve --addr a..b:29650` ended in a UnicodeError traceback (exit 1).
    code = featurestore_main(["stream-serve", "--addr", "a..b:29650", "--engine-rank", "0", "--timeout-s", "5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("featurestore: error: --addr: host 'a..b' is neither an IP address"), err


def test_a_second_trainer_process_with_the_same_rank_is_refused_at_once():
    """Two processes both given trainer rank 1: the second overwrote the first's share, the group never
    formed, every participant waited train.stream.timeout_s (30 min by default) and the process
    aborted ('terminate called without an active exception'). Now the second is refused at once and
    the stream goes on for the rest."""
    addr, seqs = _free_addr(), [[3 + i] * (4 + i) for i in range(4)]
    out: dict = {}

    def rank(r, name):
        rs = RankStream(addr, rank=r, world_size=2, num_engines=1, spec={}, sequences=seqs, steps=list(range(4)),
                        depth=2, timeout_s=60)
        out[name] = [rs.next()[0].tolist() for _ in seqs]
        rs.close()

    def engine():
        out["engine"] = serve(addr, 0, timeout_s=60, captures=_frames)

    threads = [threading.Thread(target=rank, args=(0, "rank 0"), daemon=True)]
    threads[0].start()
    time.sleep(0.3)  # rank 0 hosts the store
    threads.append(threading.Thread(target=rank, args=(1, "rank 1"), daemon=True))
    threads[1].start()
    time.sleep(0.5)  # the first rank 1 claims its rank
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"capture stream: trainer rank 1 at {addr} is already taken by the "
                                          r"process on .* pid \d+"):
        RankStream(addr, rank=1, world_size=2, num_engines=1, spec={}, sequences=seqs, steps=list(range(4)),
                   depth=2, timeout_s=60)
    assert time.monotonic() - t0 < 10
    threads.append(threading.Thread(target=engine, daemon=True))
    threads[2].start()
    for t in threads:
        t.join(60)
    assert out == {"rank 0": seqs, "rank 1": seqs, "engine": 0}


@pytest.fixture
def wide_target(tmp_path, tiny_target):
    """The tiny target with twice its hidden size and 12 layers in config.json (its weights linked)."""
    dst = tmp_path / "wide"
    shutil.copytree(tiny_target, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    (dst / "model.safetensors").symlink_to(tiny_target / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(hidden_size=256, num_hidden_layers=12)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("given", [True, False])
def test_stream_serve_refuses_a_target_of_another_shape_before_joining(tiny_target, wide_target, given):
    """`stream-serve --target` of another model than the trainer's run.target (or, without it, another
    model at run.target's path on this host) joined the group and streamed states of another width
    (the trainer failed in its first step, after the engine start) or, with more layers, a middle
    layer as the "last" one (trained on silently)."""
    import torch.distributed as dist

    addr = _free_addr()
    store = dist.TCPStore("127.0.0.1", int(addr.rsplit(":", 1)[1]), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=90))
    trainers = str(tiny_target) if given else str(wide_target)  # the path the trainer names
    store.set("spec", json.dumps({"protocol": PROTOCOL, "world_size": 1, "num_engines": 1, "depth": 2, "window": 2,
                                  "target": trainers, "layer_ids": [1, 3, 5], "num_layers": 8,
                                  "hidden_size": 128, "engine": {}}))
    what = f"--target {wide_target}" if given else f"{wide_target} (the trainer's run.target, as it is on this host)"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        # no captures: what a real stream-serve runs (it is refused before its engine would start)
        serve(addr, 0, target=str(wide_target) if given else None, timeout_s=90)
    assert str(info.value) == (f"{what}: num_layers 12, hidden_size 256, but the trainer's model has num_layers 8, "
                               "hidden_size 128: give stream-serve the trainer's model (--target DIR)")
    assert time.monotonic() - t0 < 60  # the target's files read (a tokenizer load): no wait on the group
    assert not store.check(["claim/engine-0"])  # refused before it claimed its rank or joined


def test_captures_of_another_width_fail_the_rank_in_one_line():
    """A stream-serve of an older eaglenest (no check of its --target) streaming another model's
    states: the rank's first capture is refused naming the shapes, and the engine is told (abort)."""
    addr, seqs = _free_addr(), [[3 + i] * (4 + i) for i in range(3)]
    out: dict = {}

    def engine():
        try:
            # timeout_s bounds its send of the refused frame's rest: a real rank's exit ends that send at once
            serve(addr, 0, timeout_s=10, captures=lambda spec, s: _frames(spec, s, layers=4, hidden=16))
        except StoreError as exc:
            out["engine"] = str(exc)

    rs = None
    worker = threading.Thread(target=engine, daemon=True)
    try:
        def start_engine():
            time.sleep(0.5)
            worker.start()

        threading.Thread(target=start_engine, daemon=True).start()
        rs = RankStream(addr, rank=0, world_size=1, num_engines=1, depth=2, timeout_s=60, sequences=seqs,
                        steps=[0, 0, 1], spec={"layer_ids": [1, 3, 5], "hidden_size": 128})
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"capture stream: bad frame from engine 0 at position 0: hidden states "
                                             r"\[4, 4, 16\] where the trainer's target has \[4, 4, 128\]"):
            rs.next()
        assert time.monotonic() - t0 < 10
    finally:
        if rs is not None:
            rs.close()
    worker.join(60)
    assert not worker.is_alive()
    assert out["engine"].startswith("capture stream"), out  # its own line, the rank's abort or its lost send



def _next_within(chan, seconds: float):
    """``chan.next()`` run with a bound: (the exception it raised, or its result) or 'hung'."""
    got: list = []

    def call():
        try:
            got.append(chan.next())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return got[0] if got else "hung"


@pytest.mark.parametrize("header_bytes, header, problem", [
    (2**32 - 1, b"", "a header of 4294967295 bytes, more than 65536"),
    (3, b"\xff{[", "its header is not a JSON object"),
    (2, b"[]", "its header is not a JSON object"),
])
def test_a_frame_header_of_no_sane_size_or_not_json_is_one_line(short_tmp, header_bytes, header, problem):
    """The consumer read a header of whatever length the frame claimed: 4 GiB claimed, a few bytes
    sent, and it waited for the rest for ever; a header not JSON was 'JSONDecodeError: ...'."""
    from eaglenest.featurestore.capture.publish import FRAME, MAGIC
    from eaglenest.featurestore.stream.local import Channel

    chan = Channel(str(short_tmp / "c.sock"), num_items=1, depth=1, check=lambda: None, poll_s=0.05)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(chan.path)
            assert client.recv(1)  # the credit
            client.sendall(FRAME.pack(MAGIC, header_bytes, 0) + header)
            got = _next_within(chan, 10)
            assert isinstance(got, StoreError), got
            assert str(got) == f"capture stream: bad frame ({problem}; a publisher of another eaglenest version?)"
    finally:
        chan.close()


def test_the_trainers_spec_carries_the_shape_engines_are_checked_against(tmp_path, tiny_target, monkeypatch):
    """What the checks above compare with: the spec a gloo trainer rank publishes names its target's
    layer count and hidden size (it named neither the width nor, for the rank, the layers to expect)."""
    from stream_helpers import FS, prompts

    from eaglenest.featurestore.table import store
    from eaglenest.train import stream_source

    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, prompts(3))
    seen = {}
    monkeypatch.setattr(stream_source, "RankStream", lambda addr, **kw: seen.update(kw))
    src = stream_source.StreamShards(uri, featurestore=FS, target=str(tiny_target), split="train", pack_tokens=256,
                                     batch_rows=1, seed=0, depth=2, transport="gloo", addr="127.0.0.1:1")
    src.start([(0, src.plan(0)[0])], rank=0)
    assert seen["spec"]["num_layers"] == 8 and seen["spec"]["hidden_size"] == 128
    assert seen["spec"]["layer_ids"] == list(src.meta.layer_ids)
