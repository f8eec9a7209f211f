"""Mutation audit of the feature store's sample reader (qa7): behaviours no earlier test pinned,
each checked against an independent reference (the stored bytes decoded with numpy/torch)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.pread import BufferPool
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.read.sample import Into
from eaglenest.featurestore.table import store

import fs_helpers as H  # on sys.path via conftest


def _table(m, sizes: list[int], seed: int = 0) -> tuple[pa.Table, list[tuple[np.ndarray, np.ndarray]]]:
    """Rows of ``sizes`` tokens with random float32 states, and the states themselves (the reference)."""
    rng = np.random.default_rng(seed)
    rows, ref = [], []
    for k, T in enumerate(sizes):
        aux = rng.standard_normal((T, len(m.layer_ids), m.hidden_size)).astype(np.float32)
        last = rng.standard_normal((T, m.hidden_size)).astype(np.float32)
        ref.append((aux, last))
        rows.append({"sample_id": f"r{k}", "domain": "d", "source": "s", "split": "train", "mode": "chat",
                     "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": T - 1, "input_ids": list(range(T)),
                     "loss_mask": [0] + [1] * (T - 1), "aux_hidden": S.encode_value(aux, m),
                     "last_hidden": S.encode_value(last, m)})
    return pa.Table.from_pylist(rows, schema=S.features_schema(m)), ref


def test_pooled_reads_of_values_past_one_pool_step_are_whole(tmp_path):
    """Pooled buffers grow in 8 MiB steps: a 9.4 MiB value (not a multiple of the step) is read whole
    into a recycled buffer, bit for bit the value written, and so is a small one after it."""
    uri, m = str(tmp_path / "store"), H.meta(hidden=1024)
    t, ref = _table(m, [800, 3])  # aux of 800 tokens x 3 layers x 1024 x 4 bytes: 9.4 MiB
    store.append(uri, store.FEATURES, t, meta=m)
    with SampleReader(store.dataset(uri, store.FEATURES), recycle=True) as reader:
        for s, (aux, last) in zip(reader.iter_samples([0, 1, 0]), [ref[0], ref[1], ref[0]]):
            assert np.array_equal(s.aux_stored().numpy(), aux) and np.array_equal(s.last_stored().numpy(), last)
            s.release()
    big = S.value_bytes(m, np.array([800]), len(m.layer_ids))[0]
    assert big > 8 << 20 and big % (8 << 20)


def test_a_budget_of_one_sample_holds_one_sample_from_the_first_read(tmp_path):
    """The memory bound knows a sample's size before reading it: with a budget of one sample, the
    next one is read only after the consumer released the last, from the very first samples (the
    window starts at 2 and would otherwise read two before measuring any). Recycled buffers: the
    reader's peak allocation is one sample's two buffers, reused for every sample after it."""
    uri, m = str(tmp_path / "store"), H.meta(dtype="float32", hidden=256)
    t, ref = _table(m, [64] * 4)  # aux 64 x 3 x 256 x 4 = 192 KiB, last 64 KiB a sample
    store.append(uri, store.FEATURES, t, meta=m)
    one = int(S.value_bytes(m, np.array([64]), len(m.layer_ids))[0] + S.value_bytes(m, np.array([64]), 1)[0])
    with SampleReader(store.dataset(uri, store.FEATURES), recycle=True, memory_budget=one) as reader:
        for k, s in enumerate(reader.iter_samples(range(4))):
            assert np.array_equal(s.aux_stored().numpy(), ref[k][0])
            s.release()
        assert reader.pool.peak_live == BufferPool.rounded(192 << 10) + BufferPool.rounded(64 << 10)


def test_the_read_straight_into_a_destination_refuses_what_does_not_fit(tmp_path, monkeypatch):
    """The stored dtype's own destination is filled by ``pread`` with no converting copy: one of more
    tokens than the sample would take the next value's bytes as its last token, and a stored value
    longer than its ``num_tokens`` (an unchecking writer) would be read in part; both are refused by row."""
    m = H.meta(dtype="float32", hidden=8)
    uri, rows = str(tmp_path / "store"), H.rows(["a", "b-long"], m, num_tokens=4)
    rows[1]["aux_hidden"] += bytes(3 * 8 * 4)  # one token more than its num_tokens says
    with monkeypatch.context() as patch:
        patch.setattr(S, "row_problem", lambda table, meta: None)
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        fits = Into(aux=torch.empty(4, 3, 8), last=torch.empty(4, 8))
        r.read([0], into=[fits])
        want = S.decode_tensor(rows[0]["aux_hidden"], (4, 3, 8), "float32")
        assert np.array_equal(fits.aux.numpy(), want)
        with pytest.raises(SchemaError, match=r"^row 0: destination \(5, 3, 8\) / \(5, 8\) does not fit"):
            r.read([0], into=[Into(aux=torch.empty(5, 3, 8), last=torch.empty(5, 8))])
        with pytest.raises(SchemaError, match=r"^row 1: aux_hidden holds 576 bytes, not 5 tokens of 96"):
            r.read([1], into=[Into(aux=torch.empty(5, 3, 8), last=torch.empty(5, 8))])
