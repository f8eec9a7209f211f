"""An engine host whose TMPDIR is too deep for the stream's Unix socket (``featurestore stream-serve``),
hostile pass 12. Its local capture stream was opened only once the group had formed: the refusal then
aborted the whole stream, every trainer rank failing with it, and the job had to be started again.
Now it is one line naming TMPDIR before the engine claims its rank: the trainer waits on, and the
engine started again with a short TMPDIR feeds it to the end. No engine starts (the refusal comes
first; the restart's frames are made without one, the transport is real)."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import threading
import time

import numpy as np
import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.xhost import RankStream, serve

pytestmark = [pytest.mark.serial, pytest.mark.timeout(180)]  # bounds how long the rank waits


@contextlib.contextmanager
def _frames(spec, sequences):
    import torch

    yield ((np.asarray(s, dtype=np.int64), torch.zeros(len(s), 4, 8, dtype=torch.bfloat16)) for s in sequences)


def test_a_deep_tmpdir_on_an_engine_host_is_refused_before_it_joins(tmp_path, monkeypatch, tiny_target):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    seqs = [[5 + i] * (4 + i) for i in range(4)]
    spec = {"target": str(tiny_target), "layer_ids": [1, 3, 5], "num_layers": 8,
            "engine": {"max_model_len": 128}, "window": 2, "trust_remote_code": False}
    out: dict = {}

    def rank():
        rs = RankStream(addr, rank=0, world_size=1, num_engines=1, spec=spec, sequences=seqs,
                        steps=list(range(len(seqs))), depth=2, timeout_s=90)
        try:
            out["rank"] = [rs.next()[0].tolist() for _ in seqs]
        except StoreError as exc:
            out["rank error"] = str(exc)
        finally:  # as the trainer's data source does
            rs.close()

    trainer = threading.Thread(target=rank, daemon=True)
    trainer.start()
    time.sleep(0.5)  # rank 0 hosts the store
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot listen at .*captures\.sock .*set TMPDIR to a shorter folder"):
        serve(addr, 0, timeout_s=90)
    assert time.monotonic() - t0 < 30
    assert list(deep.iterdir()) == []
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert serve(addr, 0, timeout_s=90, captures=_frames) == 0  # the same rank, started again: not taken
    trainer.join(60)
    assert out == {"rank": seqs}
