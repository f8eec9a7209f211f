"""Streaming bypass, sixth QA pass: bad train.stream.* values refused when the recipe loads, and
failures of a stream (a dead engine, a dead trainer) that end in one line, without an engine where
a stand-in shows the same path."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from eaglenest.config import apply_overrides, build
from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.stream.local import CaptureStream
from eaglenest.featurestore.stream.producer import ENGINE_DIED
from eaglenest.featurestore.stream.addr import MAX_TIMEOUT_S
from eaglenest.train.config import TrainConfig


def _train(*overrides: str) -> TrainConfig:
    return build(TrainConfig, apply_overrides({}, list(overrides)).get("train"), where="train")


@pytest.mark.parametrize("value, shown", [("1e300", "1e+300"), (str(MAX_TIMEOUT_S + 1), "31536001.0")])
def test_a_timeout_past_a_year_is_refused_when_the_recipe_loads(value, shown):
    """1e300 passed the recipe and was refused only by the stream's Group, once the trainer had read
    the prompts, loaded the target and started torchrun's ranks."""
    with pytest.raises(ConfigError) as err:
        _train(f"train.stream.timeout_s={value}")
    assert str(err.value) == (f"train.stream.timeout_s: a number of seconds > 0 and at most {MAX_TIMEOUT_S:.0f} "
                              f"(a year), got {shown}")


def test_a_timeout_of_a_year_still_loads():
    assert _train(f"train.stream.timeout_s={MAX_TIMEOUT_S}").stream.timeout_s == MAX_TIMEOUT_S


@pytest.fixture
def silent_listener():
    """``host:port`` of something that accepts connections and never answers: a trainer rank 0 that
    is stopped (SIGSTOP, a debugger) still completes connections in the kernel, or another service."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.serial  # bounds how soon the failure comes
def test_a_store_that_accepts_and_never_answers_fails_within_the_timeout(silent_listener):
    """The TCPStore client's handshake has no timeout of its own: stream-serve (or a trainer rank > 0)
    pointed at a stopped rank 0 or at another service waited for ever, whatever --timeout-s said."""
    from eaglenest.featurestore.stream.xhost import Group

    box: dict = {}

    def connect():
        try:
            Group(silent_listener, is_master=False, timeout_s=2.0, who="engine 0", key="--addr")
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    started = time.monotonic()
    worker = threading.Thread(target=connect, daemon=True)  # a hang must fail the test, not stall the suite
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "the stream store's client still waits after 20 s (timeout_s=2)"
    assert time.monotonic() - started < 15
    err = box.get("error")
    assert isinstance(err, StoreError), err
    assert str(err).startswith(f"capture stream (engine 0): cannot reach the stream store at {silent_listener}: ")
    assert "did not answer" in str(err) and "2 s" in str(err) and "\n" not in str(err)



#: Fault injection into the real engine's processes (``sitecustomize`` runs in every interpreter the
#: producer starts): the worker about to send the first capture SIGKILLs its EngineCore (its parent)
#: and itself instead, as the OOM killer would end the EngineCore before its first frame.
_DIE_AT_FIRST_PUBLISH = """\
import os, signal
from eaglenest.featurestore.capture import publish
def _die(self, *args, **kwargs):
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
publish.Publisher.publish = _die
"""


@pytest.mark.slow
@pytest.mark.serial  # bounds how soon the failure shows
def test_an_engine_killed_before_its_first_capture_ends_the_stream_in_one_line(tiny_target, short_tmp):
    """The EngineCore killed before a frame was sent: the connection to the trainer's socket was never
    made, so no EOF told the trainer, and the producer waited in vLLM's generate(), which never wakes
    when its EngineCore dies: the trainer (train.source=stream has no timeout) waited for ever."""
    hook = short_tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DIE_AT_FIRST_PUBLISH)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    engine = EngineConfig(max_model_len=128, memory_fraction=0.1, max_num_seqs=1)
    box: dict = {}

    def consume(stream):
        try:
            box["first"] = stream.next()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["error"] = exc

    with CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=engine,
                       sequences=[[5 + i] * 20 for i in range(3)], depth=1, window=1, poll_s=0.2,
                       env={"PYTHONPATH": path}) as stream:
        consumer = threading.Thread(target=consume, args=(stream,), daemon=True)
        consumer.start()
        consumer.join(240)  # an engine start (up to ~150 s at a load of 8 on 2 cores), then the failure
        hung = consumer.is_alive()
        pid = stream.proc.pid if stream.proc is not None else None
    assert not hung, "the trainer still waits for the first capture of an engine that died"
    err = box.get("error")
    assert isinstance(err, StoreError), box
    assert re.fullmatch(rf"capture stream: the producer \(pid {pid}\) exited with code {ENGINE_DIED} after 0 of 3 "
                        r"captures: .*the capture engine died.*; its log: \S+/producer\.log", str(err)), str(err)
    assert "the capture engine died" in Path(str(err).rsplit("its log: ", 1)[1]).read_text()


def test_a_producer_that_fails_exits_with_its_code_not_an_abort(short_tmp):
    """A producer whose engine cannot start (a target that is not there) raised, and the interpreter,
    exiting while the control thread sat in a read of stdin, aborted on that stream's lock: the
    trainer said the producer 'was killed by signal 6' and its log ended in 'Fatal Python error'."""
    missing = short_tmp / "no-such-target"
    with CaptureStream(str(missing), layer_ids=[1, 3, 5], num_layers=8, engine=EngineConfig(), sequences=[[5, 6]],
                       poll_s=0.1) as stream:
        with pytest.raises(StoreError) as info:
            stream.next()
        pid = stream.pid
    assert re.fullmatch(rf"capture stream: the producer \(pid {pid}\) exited with code 1 after 0 of 1 captures: "
                        r".*no-such-target.*; its log: \S+/producer\.log", str(info.value)), str(info.value)
    log = Path(str(info.value).rsplit("its log: ", 1)[1]).read_text()
    assert "no-such-target" in log and "Fatal Python error" not in log
