"""The fast read path (featurestore.reader, train.data.FeatureShards.read) against plain reference
decodes, schema versions 1 and 2, and fp8_e4m3 storage (round-trip error, bytes per token)."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import maintenance, store
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.train.data import FeatureShards, collate

LAYERS = (5, 2, 4)  # not ascending: the trainer must reorder aux layers


def _meta(dtype="bfloat16", hidden=16, storage="raw"):
    return S.FeatureMeta(target="t", layer_ids=LAYERS, last_layer_id=8, hidden_size=hidden, dtype=dtype,
                         storage=storage, feature_set_id=f"fs-{dtype}-{storage}")


def _arrays(n, hidden, seed=0):
    """``n`` samples of 3-12 tokens; float32 aux/last with row scales spanning 1e-3..1e3."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        T = int(rng.integers(3, 13))
        scale = 10.0 ** rng.uniform(-3, 3, (T, len(LAYERS), 1))
        aux = (rng.standard_normal((T, len(LAYERS), hidden)) * scale).astype("f4")
        last = (rng.standard_normal((T, hidden)) * 10.0 ** rng.uniform(-3, 3, (T, 1))).astype("f4")
        out.append((f"s{k:02d}", rng.integers(0, 50, T).astype("i4"), aux, last))
    return out


def _stored(x, dtype):
    t = torch.from_numpy(x).to({"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
    return t.view(torch.uint16).numpy() if dtype == "bfloat16" else t.numpy()


def _rows(samples, m):
    return [{"sample_id": sid, "domain": "d", "source": "s", "split": "train", "mode": "chat", "gen_params_id": "g",
             "num_tokens": len(ids), "num_loss_tokens": len(ids) - 1, "input_ids": ids.tolist(),
             "loss_mask": [0] + [1] * (len(ids) - 1),
             "aux_hidden": S.encode_value(_stored(aux, m.dtype), m),
             "last_hidden": S.encode_value(_stored(last, m.dtype), m)} for sid, ids, aux, last in samples]


def _write(uri, samples, m, *, commits=2):
    rows = _rows(samples, m)
    step = -(-len(rows) // commits)
    for i in range(0, len(rows), step):
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows[i:i + step], schema=S.features_schema(m)), meta=m)
    return rows


def _reference(uri, m, pack_tokens):
    """Plain decode of every row from store.read bytes (no reader code): the collate inputs."""
    order = np.argsort(np.asarray(m.layer_ids), kind="stable")
    out = []
    for r in store.read(uri, store.FEATURES).to_pylist():
        T, n = r["num_tokens"], min(r["num_tokens"], pack_tokens)
        if m.storage == "raw":
            aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), m.dtype).float()
            last = S.torch_from_blob(r["last_hidden"], (T, m.hidden_size), m.dtype).float()
        else:
            aux = S.decode_fp8(r["aux_hidden"], (T, 3, m.hidden_size))
            last = S.decode_fp8(r["last_hidden"], (T, m.hidden_size))
        out.append((torch.tensor(r["input_ids"][:n]), torch.tensor(r["loss_mask"][:n]).bool(),
                    aux[:n, order].reshape(n, -1), last[:n]))
    return out


def _assert_batches_equal(a, b):
    for f in ("input_ids", "loss_mask", "doc_ids", "position_ids", "aux", "last_hidden"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f


@pytest.mark.parametrize("dtype,storage", [("bfloat16", "raw"), ("float32", "fp8_e4m3")])
def test_trainer_read_equals_collate_of_plain_decode(tmp_path, dtype, storage):
    m = _meta(dtype, storage=storage)
    uri = str(tmp_path)
    _write(uri, _arrays(9, m.hidden_size), m)
    ds = store.dataset(uri, store.FEATURES)
    assert S.tensor_layout(ds.schema) == "blob" and len(ds.get_fragments()) == 2
    ref = _reference(uri, m, pack_tokens=10)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=10, batch_rows=2, seed=3, read_threads=3)
    for rows in shards.plan(0):
        _assert_batches_equal(shards.read(rows), collate([[ref[i] for i in row] for row in rows]))
    shards.reader.close()


def test_reader_views_are_bit_exact_in_any_order(tmp_path):
    m = _meta("bfloat16")
    rows = _write(str(tmp_path), _arrays(7, m.hidden_size, seed=1), m, commits=3)
    order = [5, 0, 6, 2, 1, 4, 3] * 2
    # recycle: each sample's buffers go back to the pool once checked, so later reads reuse them.
    with SampleReader(store.dataset(str(tmp_path), store.FEATURES), threads=3, recycle=True) as reader:
        for s, i in zip(reader.iter_samples(order), order):
            assert s.index == i and s.input_ids.tolist() == rows[i]["input_ids"]
            assert s.aux_stored().dtype == torch.bfloat16
            assert s.aux_stored().contiguous().view(torch.uint8).numpy().tobytes() == rows[i]["aux_hidden"]
            assert s.last_stored().contiguous().view(torch.uint8).numpy().tobytes() == rows[i]["last_hidden"]
            s.release()
        assert 0 < len(reader.pool._free) <= 2 * (reader.threads + 1)


def _version1_table(uri, samples, m):
    """A table as eaglenest wrote it before schema version 2: plain large_binary tensor columns."""
    import lance

    fields = [pa.field(f.name, f.type, nullable=f.nullable) for f in S.FEATURES_SCHEMA]
    md = {**S.features_schema(m).metadata, b"eaglenest.schema_version": b"1"}
    schema = pa.schema(fields, metadata=md)
    lance.write_dataset(pa.Table.from_pylist(_rows(samples, m), schema=schema),
                        str(store.table_path(uri, store.FEATURES)), schema=schema, data_storage_version="2.0")


def test_version1_tables_read_through_take_and_refuse_appends(tmp_path):
    m = _meta("bfloat16")
    uri = str(tmp_path)
    samples = _arrays(5, m.hidden_size, seed=2)
    _version1_table(uri, samples, m)
    ds = store.dataset(uri, store.FEATURES)
    assert S.schema_version(ds.schema) == 1 and S.tensor_layout(ds.schema) == "inline"
    ref = _reference(uri, m, pack_tokens=64)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=2, seed=0)
    for rows in shards.plan(0):
        _assert_batches_equal(shards.read(rows), collate([[ref[i] for i in row] for row in rows]))
    shards.reader.close()
    more = pa.Table.from_pylist(_rows(_arrays(1, m.hidden_size, seed=9), m), schema=S.features_schema(m))
    with pytest.raises(SchemaError, match="schema version 1 .*writes version 2"):
        store.append(uri, store.FEATURES, more, meta=m)


def test_unreadable_schema_version_is_a_clear_error(tmp_path):
    import lance

    m = _meta("float32")
    schema = S.features_schema(m).with_metadata({**S.features_schema(m).metadata, b"eaglenest.schema_version": b"9"})
    lance.write_dataset(schema.empty_table(), str(store.table_path(str(tmp_path), store.FEATURES)), schema=schema)
    with pytest.raises(SchemaError, match="schema version 9, this eaglenest reads 1, 2"):
        store.dataset(str(tmp_path), store.FEATURES)


def test_fp8_round_trip_error_and_bytes_per_token(tmp_path):
    hidden = 256
    samples = _arrays(6, hidden, seed=4)
    # Round trip: per element within e4m3's half spacing (3 mantissa bits: 2^-4 relative, and 2^-10
    # of the row scale in the subnormal range), per token row within 2^-4 in L2.
    for _, _, aux, last in samples:
        for x in (aux, last):
            y = S.decode_fp8(S.encode_fp8(x, "float32"), x.shape).numpy()
            scale = np.abs(x).max(-1, keepdims=True) / S.FP8_MAX
            assert (np.abs(y - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scale + 1e-6 * np.abs(x)).all()
            rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
            assert rel.max() <= 2.0 ** -4 and rel.mean() > 1e-3  # lossy, and not by accident exact
    # Bytes on disk per token: fp8 about half of bf16 (e4m3 codes + one fp32 scale per row).
    sizes = {}
    for dtype, storage in (("bfloat16", "raw"), ("float32", "fp8_e4m3")):
        uri = str(tmp_path / storage)
        _write(uri, samples, _meta(dtype, hidden, storage), commits=1)
        assert maintenance.verify(uri, store.FEATURES)["ok"]
        sizes[storage] = sum(p.stat().st_size for p in (store.table_path(uri, store.FEATURES) / "data").iterdir())
    assert 0.48 < sizes["fp8_e4m3"] / sizes["raw"] < 0.55


def test_fp8_nonfinite_is_found_by_verify(tmp_path):
    m = _meta("float32", storage="fp8_e4m3")
    rows = _rows(_arrays(3, m.hidden_size, seed=5), m)
    aux = np.ones((rows[1]["num_tokens"], 3, m.hidden_size), "f4")
    aux[0, 1, 2] = np.inf
    rows[1]["aux_hidden"] = S.encode_fp8(aux, "float32")
    store.append(str(tmp_path), store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = maintenance.verify(str(tmp_path), store.FEATURES)
    assert not report["ok"] and "NaN/inf in aux_hidden" in report["problems"][0] and "s01" in report["problems"][0]
