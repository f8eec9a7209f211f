"""The capture engine dying mid-stream (its EngineCore killed, as the OOM killer would), hostile pass 12.

The publisher runs in the engine, so the trainer first sees the connection close: it said only
'the engine closed the connection after 1 of 3 captures', and close() then deleted the stream's temp
folder with the producer's log, the one file saying why the engine died. The producer exits within
seconds once its EngineCore is dead (``producer.ENGINE_DIED``): the trainer now waits for that exit
and reports it like any producer failure, with its log's error line and the log's path, which stays.
A real engine (the tiny target); a ``sitecustomize`` hook kills it at its second capture."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.local import DIR_PREFIX, CaptureStream
from eaglenest.featurestore.stream.producer import ENGINE_DIED

_DIE_AT_SECOND_PUBLISH = """\
import os, signal
from eaglenest.featurestore.capture import publish
_publish = publish.Publisher.publish
def _die_at_second(self, *args, **kwargs):
    if self._seq >= 1:  # one capture sent: the engine's process (and its parent, the EngineCore) die
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return _publish(self, *args, **kwargs)
publish.Publisher.publish = _die_at_second
"""


@pytest.mark.slow
@pytest.mark.serial  # bounds how soon the failure shows
def test_an_engine_that_dies_mid_stream_is_named_with_the_log_that_says_why(tiny_target, short_tmp):
    hook = short_tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DIE_AT_SECOND_PUBLISH)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    engine = EngineConfig(max_model_len=128, memory_fraction=0.1, max_num_seqs=1)
    seqs = [[5 + i] * 20 for i in range(3)]
    with CaptureStream(str(tiny_target), layer_ids=[1, 3, 5], num_layers=8, engine=engine, sequences=seqs,
                       depth=1, window=1, poll_s=0.2, env={"PYTHONPATH": path}) as stream:
        ids, _ = stream.next()
        assert ids.tolist() == seqs[0]
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            stream.next()
        waited = time.monotonic() - t0
        pid = stream.pid
    msg = str(info.value)
    assert re.fullmatch(rf"capture stream: the producer \(pid {pid}\) exited with code {ENGINE_DIED} after 1 of 3 "
                        r"captures: .*the capture engine died.*; its log: \S+/producer\.log", msg), msg
    assert waited < 60
    log = Path(msg.rsplit("its log: ", 1)[1])
    assert "the capture engine died" in log.read_text()
    # exactly the folder the error names is left, without its socket
    assert [p for p in short_tmp.iterdir() if p.name.startswith(DIR_PREFIX)] == [log.parent]
    assert [p.name for p in log.parent.iterdir()] == ["producer.log"]
