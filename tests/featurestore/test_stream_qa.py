"""Bad input to the streaming bypass, without an engine: one clear StoreError or ConfigError, nothing
left behind (the stream's address, stream-serve's timeout, the consumer's socket path, bad frames)."""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.capture.publish import FRAME, MAGIC
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.stream.local import CaptureStream, Channel
from eaglenest.featurestore.stream.xhost import Group


@pytest.mark.parametrize("addr", ["host:²", "host:١٢٣", "host:", ":29650", "[]:29650", "host:65536"])
def test_addr_refuses_what_is_no_port_naming_the_key(addr):
    # '²' and '١٢٣' are digits to str.isdigit: the first was a ValueError traceback, the second port 123.
    with pytest.raises(ConfigError, match=r"train\.stream\.addr: .*got " + re.escape(repr(addr))):
        parse_addr(addr)


def test_addr_takes_a_bracketed_ipv6_host():
    assert parse_addr("[::1]:29650") == ("::1", 29650)  # "[::1]" itself resolves to no host
    assert parse_addr("10.0.0.5:29650") == ("10.0.0.5", 29650)


@pytest.mark.parametrize("timeout", ["nan", "inf", "-5", "0", "1e300"])
def test_stream_serve_refuses_a_timeout_that_is_no_duration(timeout, capsys):
    """No traceback (a timedelta of nan or inf raised), and no wait at all on a negative one."""
    code = featurestore_main(["stream-serve", "--addr", "127.0.0.1:1", "--engine-rank", "0", "--timeout-s", timeout])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    shown = repr(float(timeout)) if math.isfinite(float(timeout)) else timeout
    assert err[0].startswith(f"featurestore: error: capture stream (engine 0): timeout {shown} s:"), err
    assert "--timeout-s" in err[0]


def test_a_socket_path_too_long_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, tiny_target):
    """A deep TMPDIR: the kernel refuses a Unix socket path over 107 bytes (an OSError traceback,
    and the stream's temp folder stayed behind)."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(StoreError, match=r"cannot listen at .*captures\.sock .*set TMPDIR to a shorter folder"):
        CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(),
                      sequences=[[5, 6, 7]])
    assert list(deep.iterdir()) == []
    with pytest.raises(StoreError, match="stream depth must be >= 1, got 0"):
        CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(),
                      sequences=[[5, 6, 7]], depth=0)
    assert list(deep.iterdir()) == []


def _frame(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return FRAME.pack(MAGIC, len(raw), len(payload)) + raw + payload


GOOD = {"tag": 0, "seq": 0, "shape": [2, 1, 4], "dtype": "float32", "sent_at": 0.0}



@pytest.mark.parametrize("header,payload_bytes,problem", [
    (GOOD, 2 * 8 + 2 * 4 * 4 - 4, "44 payload bytes for shape [2, 1, 4], expected 48"),  # one value short
    ({**GOOD, "dtype": "int8"}, 2 * 8 + 8, "dtype 'int8' is not one of"),
    ({**GOOD, "shape": [2, 4]}, 2 * 8 + 32, "shape [2, 4] is not [tokens, layers, hidden]"),
    ({**GOOD, "shape": [-1, 1, 4]}, 0, "shape [-1, 1, 4] is not"),
])
def test_a_malformed_frame_is_a_store_error_naming_it(short_tmp, header, payload_bytes, problem):
    """A frame whose header does not describe its payload used to reach the consumer as a numpy
    ValueError (or a KeyError for a dtype), not the stream's one-line StoreError."""
    chan = Channel(str(short_tmp / "c.sock"), num_items=1, depth=1, check=lambda: None, poll_s=0.05)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(chan.path)
            assert client.recv(1)  # the credit
            client.sendall(_frame(header, b"\0" * payload_bytes))
            with pytest.raises(StoreError, match=re.escape(f"capture stream: bad frame ({problem}")):
                chan.next()
    finally:
        chan.close()


def test_a_well_formed_frame_still_passes(short_tmp):
    import torch

    chan = Channel(str(short_tmp / "c.sock"), num_items=1, depth=1, check=lambda: None, poll_s=0.05)
    hidden = torch.arange(8, dtype=torch.float32).reshape(2, 1, 4)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(chan.path)
            assert client.recv(1)
            ids = torch.tensor([7, 9], dtype=torch.int64).numpy().tobytes()
            client.sendall(_frame(GOOD, ids + hidden.numpy().tobytes()))
            got_ids, got = chan.next()
        assert got_ids.tolist() == [7, 9] and torch.equal(got, hidden)
    finally:
        chan.close()


@contextlib.contextmanager
def _frames(spec, sequences):
    """Captures made without an engine (the transport is under test): bf16 zeros of each length."""
    import torch

    yield ((np.asarray(s, dtype=np.int64), torch.zeros(len(s), 2, 8, dtype=torch.bfloat16)) for s in sequences)


@pytest.mark.serial  # bounds how soon the refusal comes
def test_a_second_stream_serve_with_the_same_engine_rank_is_refused_at_once():
    """Two engine hosts started with the same --engine-rank: the group never formed, and every
    participant waited train.stream.timeout_s (30 min by default) to fail with 'did not form'."""
    from eaglenest.featurestore.stream.xhost import RankStream, serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    seqs = [[3 + i] * (4 + i) for i in range(6)]
    out: dict = {}

    def rank():
        rs = RankStream(addr, rank=0, world_size=1, num_engines=2, spec={}, sequences=seqs, steps=list(range(6)),
                        depth=2, timeout_s=60)
        out["rank"] = [rs.next()[0].tolist() for _ in seqs]
        rs.close()

    def engine(e):
        out[f"engine {e}"] = serve(addr, e, timeout_s=60, captures=_frames)

    threads = [threading.Thread(target=rank, daemon=True)]
    threads[0].start()
    time.sleep(0.3)  # rank 0 hosts the store
    threads.append(threading.Thread(target=engine, args=(0,), daemon=True))
    threads[1].start()
    time.sleep(0.5)  # engine 0 claims its rank first
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"--engine-rank 0: already taken by the stream-serve on .* pid \d+"):
        serve(addr, 0, timeout_s=60, captures=_frames)
    assert time.monotonic() - t0 < 10
    threads.append(threading.Thread(target=engine, args=(1,), daemon=True))  # the rank that was meant
    threads[2].start()
    for t in threads:
        t.join(60)
    assert out == {"rank": seqs, "engine 0": 0, "engine 1": 0}


def test_a_producer_that_dies_before_reading_its_spec_is_one_line(short_tmp, tiny_target):
    """A producer that cannot start (here: an interpreter without its standard library) while the
    spec, larger than a pipe's buffer as any real run's is, is being written: a BrokenPipeError
    traceback, and the stream's temp folder stayed behind."""
    with pytest.raises(StoreError, match=r"capture stream: the producer \(pid \d+\) exited with code 1 before "
                                         r"reading its spec: .*No module named 'encodings'"):
        CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(),
                      sequences=[[5] * 40_000], env={"PYTHONHOME": str(short_tmp / "none")})
    assert list(short_tmp.iterdir()) == []


@pytest.mark.slow
@pytest.mark.serial  # bounds how soon the failure shows
def test_an_engine_core_killed_under_the_producer_ends_the_stream_in_one_line(tiny_target):
    """The producer's EngineCore (where the publisher runs) killed mid-stream, as the OOM killer
    would: the trainer's error read 'capture stream: ConnectionResetError: [Errno 104] Connection
    reset by peer'; now it says the engine closed the connection, and after how many captures."""
    import psutil

    seqs = [[5 + i] * 20 for i in range(6)]
    engine = EngineConfig(max_model_len=128, memory_fraction=0.1, max_num_seqs=1)
    with CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=engine, sequences=seqs,
                       depth=1, window=1) as stream:
        ids, _ = stream.next()
        assert ids.tolist() == seqs[0]
        kids = psutil.Process(stream.proc.pid).children(recursive=True)
        core = [p for p in kids if "EngineCore" in " ".join(p.cmdline())]
        assert len(core) == 1, kids
        core[0].kill()
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=r"capture stream: (the engine closed the connection|the producer "
                                             r"\(pid \d+\) exited with code \d+) after [12] of 6 captures"):
            for _ in range(5):
                stream.next()
        assert time.monotonic() - t0 < 60


def test_the_log_a_producer_error_names_is_still_there_after_close(short_tmp):
    """The error says 'its log: <temp folder>/producer.log', and close() used to delete that folder:
    the one file saying why the producer died was gone by the time anyone read the error."""
    missing = short_tmp / "no-such-target"
    with CaptureStream(str(missing), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(), sequences=[[5, 6]],
                       poll_s=0.1) as stream:
        # Its exit code, not "killed by signal 6": the producer aborted at exit on its control thread's stdin lock.
        with pytest.raises(StoreError, match=r"the producer \(pid \d+\) exited with code 1 "
                                             r"after 0 of 1 captures: .*; its log: ") as info:
            stream.next()
    log = str(info.value).rsplit("; its log: ", 1)[1]
    assert "no-such-target" in Path(log).read_text()
    assert [p.name for p in Path(log).parent.iterdir()] == ["producer.log"]  # the socket went


@pytest.mark.parametrize("spec", [b'{"world_size": 1, "num_engines": 1}', b'{"protocol": 99}', b"\x00garbage"])
def test_a_trainer_of_another_stream_protocol_is_refused_in_one_line(spec):
    """A stream-serve of another eaglenest version than the trainer's read a spec it did not know: a
    KeyError or TypeError traceback (``EngineConfig(**spec["engine"])``), or a hang on missing shares."""
    from datetime import timedelta

    import torch.distributed as dist

    from eaglenest.featurestore.stream.xhost import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    store.set("spec", spec)
    with pytest.raises(ConfigError, match=rf"--addr 127.0.0.1:{port}: the trainer there streams with protocol "
                                          r"(None|99) and this stream-serve with 1: run the same eaglenest version"):
        serve(f"127.0.0.1:{port}", 0, timeout_s=20, captures=_frames)


def test_engine_settings_this_eaglenest_does_not_know_are_one_line():
    from eaglenest.featurestore.stream.xhost import engine_captures

    with pytest.raises(ConfigError, match=r"engine settings do not fit this stream-serve .*new_knob"):
        engine_captures({"target": "t", "layer_ids": [1], "num_layers": 2, "depth": 1, "window": 1,
                         "engine": {"new_knob": 1}}, [[1, 2]])


def test_stream_serve_names_its_own_flag_for_a_bad_address(capsys):
    # `featurestore stream-serve --addr host:` said "train.stream.addr: ...", a key the user never gave.
    assert featurestore_main(["stream-serve", "--addr", "host:", "--engine-rank", "0", "--timeout-s", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["featurestore: error: --addr: host:port of the stream's store, got 'host:'"], err


def test_an_address_that_does_not_resolve_is_said_once_while_waiting(caplog):
    # A typo'd host (or a pod's name not published yet) was retried silently for the whole timeout.
    with pytest.raises(StoreError, match=r"cannot reach the stream store at no-such-host\.invalid:29650"):
        Group("no-such-host.invalid:29650", is_master=False, timeout_s=1.5, who="engine 0")
    said = [r.getMessage() for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert len(said) == 1 and "no-such-host.invalid" in said[0], said
