"""Third QA pass over capture and the streaming bypass: empty streams, hostile inputs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from eaglenest.engine import EngineConfig
from eaglenest.featurestore.stream import local



def test_a_stream_of_no_sequence_starts_no_engine_and_leaves_nothing(short_tmp, monkeypatch, tiny_target):
    """A capture stream of no sequence (a stream-serve engine host whose trainer ranks' shares are
    empty) started a producer, hence a whole vLLM engine, to capture nothing; once it exited, the
    receiver's poll took its exit 0 for a death and kept its temp folder for the log."""
    started = []

    def popen(*args, **kwargs):
        started.append(args)
        raise AssertionError("a producer was started for a stream of no sequence")

    monkeypatch.setattr(subprocess, "Popen", popen)
    with local.CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(),
                             sequences=[], poll_s=0.05) as stream:
        assert list(stream) == []
        with pytest.raises(StopIteration):
            stream.next()
    assert started == []
    assert list(short_tmp.iterdir()) == []


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_temp_folder_a_killed_consumer_left_is_removed_by_the_next_stream(short_tmp, tiny_target):
    """A trainer killed (SIGKILL) mid-stream never ran close(): its temp folder (socket and producer
    log) stayed in the temp dir forever, one per killed run. The next stream removes such a folder
    once its consumer's pid is gone and it is stale; one kept for the log an error named (no socket
    left), one of a live process and a fresh one stay."""
    import os
    import socket
    import time

    dead, old = _dead_pid(), time.time() - 2 * local.STALE_S

    def folder(pid: int, *, sock: bool, age: float) -> Path:
        path = short_tmp / f"{local.DIR_PREFIX}{pid}-x{len(list(short_tmp.iterdir()))}"
        path.mkdir()
        (path / "producer.log").write_text("engine log\n")
        if sock:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path / local.SOCKET_NAME))
            s.close()
        os.utime(path, (age, age))
        return path

    killed = folder(dead, sock=True, age=old)
    kept_log = folder(dead, sock=False, age=old)
    live = folder(os.getpid(), sock=True, age=old)
    fresh = folder(dead, sock=True, age=time.time())
    with local.CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(),
                             sequences=[]) as stream:
        mine = Path(stream.channel.path).parent
        assert mine.name.startswith(f"{local.DIR_PREFIX}{os.getpid()}-")
    assert not killed.exists()
    assert sorted(short_tmp.iterdir()) == sorted([kept_log, live, fresh])


def test_a_tag_sent_again_after_its_capture_was_handed_out_ends_the_stream_not_a_hang(short_tmp):
    """A frame with a tag already handed out was taken as one of the stream's frames: the receiver
    stopped one frame early, the last capture was never read, and the consumer waited for it for ever
    (the receiver, which watches the producer, had ended). Refused as a tag received twice."""
    import threading

    import torch

    from eaglenest.errors import StoreError
    from eaglenest.featurestore.capture.publish import Publisher

    chan = local.Channel(str(short_tmp / "c.sock"), num_items=2, depth=2, check=lambda: None, poll_s=0.05)
    handed = threading.Event()
    xs = [torch.randn(3, 2, 4), torch.randn(4, 2, 4)]

    def publish():
        pub = Publisher(chan.path)
        pub.publish(0, torch.arange(3), xs[0])
        handed.wait(10)
        pub.publish(0, torch.arange(3), xs[0])  # tag 0 again
        pub.publish(1, torch.arange(4), xs[1])

    threading.Thread(target=publish, daemon=True).start()
    ids, hidden = chan.next()
    assert ids.tolist() == [0, 1, 2] and torch.equal(hidden, xs[0])
    handed.set()
    got: list = []

    def second():
        try:
            got.append(chan.next())
        except StoreError as exc:
            got.append(exc)

    t = threading.Thread(target=second, daemon=True)
    t.start()
    t.join(10)
    try:
        assert not t.is_alive(), "the consumer waited for ever"
        assert isinstance(got[0], StoreError) and "unexpected tag 0" in str(got[0]), got
    finally:
        chan.close()
        t.join(5)
