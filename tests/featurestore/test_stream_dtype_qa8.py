"""A cross-host stream's frames of another dtype than the trainer's features (hostile pass 8): the
rank checked a frame's shape only, so bf16 states sent to a trainer of fp32 features (or the reverse)
were trained on silently in the other precision. Now the first such frame fails the rank in one line
naming both dtypes, and the engine is told; frames of the trainer's dtype pass bit for bit. Frames
are made without an engine (the transport is under test)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest
import torch

from eaglenest.errors import StoreError
from eaglenest.featurestore.stream.xhost import RankStream, serve

pytestmark = pytest.mark.timeout(120)


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _states(seq: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[T, 4, 8] states that differ per token, layer and unit (seeded by the sequence)."""
    g = torch.Generator().manual_seed(sum(seq))
    return torch.randn(len(seq), 4, 8, generator=g).to(dtype)


def _engine(addr, dtype, out):
    @contextlib.contextmanager
    def captures(spec, sequences):
        yield ((np.asarray(s, dtype=np.int64), _states(s, dtype)) for s in sequences)

    try:
        # timeout_s bounds the send of a refused frame's rest: a real rank's exit ends that send at once
        out["engine"] = serve(addr, 0, timeout_s=10, captures=captures)
    except StoreError as exc:
        out["engine"] = str(exc)


def _stream(addr, want: str, seqs):
    return RankStream(addr, rank=0, world_size=1, num_engines=1, depth=2, timeout_s=30, sequences=seqs,
                      steps=list(range(len(seqs))), spec={"layer_ids": [1, 3, 5], "hidden_size": 8, "dtype": want})


def _run(want: str, sent: torch.dtype):
    addr, seqs = _free_addr(), [[3 + i] * (4 + i) for i in range(3)]
    out: dict = {}
    worker = threading.Thread(target=_engine, args=(addr, sent, out), daemon=True)
    threading.Timer(0.5, worker.start).start()  # rank 0 hosts the store first
    rs = _stream(addr, want, seqs)
    got: list = []
    try:
        t0 = time.monotonic()
        try:
            for _ in seqs:
                got.append(rs.next())
        except StoreError as exc:
            got.append(exc)
        assert time.monotonic() - t0 < 15
    finally:
        rs.close()
    worker.join(60)
    assert not worker.is_alive()
    return seqs, got, out


@pytest.mark.parametrize("want, sent", [("float32", torch.bfloat16), ("bfloat16", torch.float32),
                                        ("bfloat16", torch.float16)])
def test_frames_of_another_dtype_fail_the_rank_naming_both(want, sent):
    _, got, out = _run(want, sent)
    assert len(got) == 1 and isinstance(got[0], StoreError), got
    name = str(sent).removeprefix("torch.")
    assert str(got[0]) == (f"capture stream: bad frame from engine 0 at position 0: hidden states of {name} where "
                           f"the trainer's features are {want}"), str(got[0])
    assert out["engine"].startswith("capture stream"), out  # told: its own line, the abort or its lost send


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_frames_of_the_trainers_dtype_pass_bit_for_bit(dtype):
    seqs, got, out = _run(str(dtype).removeprefix("torch."), dtype)
    assert out == {"engine": 0}
    assert [ids.tolist() for ids, _ in got] == seqs
    for s, (_, hidden) in zip(seqs, got):
        assert hidden.dtype == dtype and torch.equal(hidden.view(torch.uint8), _states(s, dtype).view(torch.uint8))
