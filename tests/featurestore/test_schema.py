import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store


def _meta(dtype="float32", hidden=8):
    return S.FeatureMeta(target="t", layer_ids=(2, 4, 5), last_layer_id=8, hidden_size=hidden, dtype=dtype)


def _row(sid, aux, last, dtype):
    T = aux.shape[0]
    return {"sample_id": sid, "domain": "d", "source": "s", "split": "train", "mode": "chat",
            "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": 1,
            "input_ids": list(range(T)), "loss_mask": [0] * (T - 1) + [1],
            "aux_hidden": S.encode_tensor(aux, dtype), "last_hidden": S.encode_tensor(last, dtype)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_tensor_columns_round_trip_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    aux = torch.randn(5, 3, 8, generator=g).to(tdtype)
    last = torch.randn(5, 8, generator=g).to(tdtype)
    as_np = (lambda t: t.view(torch.uint16).numpy()) if dtype == "bfloat16" else (lambda t: t.numpy())
    meta = _meta(dtype)
    table = pa.Table.from_pylist([_row("a", as_np(aux), as_np(last), dtype)], schema=S.features_schema(meta))
    store.append(str(tmp_path), store.FEATURES, table, meta=meta)
    got = store.read(str(tmp_path), store.FEATURES).to_pylist()[0]
    back = S.torch_from_blob(got["aux_hidden"], (5, 3, 8), dtype)
    assert back.dtype == tdtype and torch.equal(back, aux)
    assert torch.equal(S.torch_from_blob(got["last_hidden"], (5, 8), dtype), last)
    assert S.feature_meta(store.dataset(str(tmp_path), store.FEATURES).schema) == meta


def test_missing_column_is_refused(tmp_path):
    meta = _meta()
    t = pa.Table.from_pylist([_row("a", np.zeros((2, 3, 8), "float32"), np.zeros((2, 8), "float32"), "float32")],
                             schema=S.features_schema(meta)).drop_columns(["loss_mask"])
    with pytest.raises(SchemaError, match="missing column 'loss_mask'"):
        store.append(str(tmp_path), store.FEATURES, t, meta=meta)
    assert not store.exists(str(tmp_path), store.FEATURES)


def test_other_feature_set_cannot_be_appended(tmp_path):
    meta = _meta()
    row = _row("a", np.zeros((2, 3, 8), "float32"), np.zeros((2, 8), "float32"), "float32")
    store.append(str(tmp_path), store.FEATURES, pa.Table.from_pylist([row], schema=S.features_schema(meta)), meta=meta)
    other = S.FeatureMeta(target="t", layer_ids=(1, 4, 5), last_layer_id=8, hidden_size=8, dtype="float32")
    with pytest.raises(SchemaError, match="another feature set"):
        store.append(str(tmp_path), store.FEATURES,
                     pa.Table.from_pylist([row], schema=S.features_schema(other)), meta=other)


def test_dtype_mismatch_and_bad_shape():
    with pytest.raises(SchemaError, match="does not match"):
        S.encode_tensor(np.zeros(3, "float64"), "float32")
    with pytest.raises(SchemaError, match="cannot be shaped"):
        S.decode_tensor(np.zeros(6, "float32").tobytes(), (4, 2), "float32")


def test_pinned_versions_and_tags(tmp_path):
    meta = _meta()
    mk = lambda sid: pa.Table.from_pylist(  # noqa: E731
        [_row(sid, np.zeros((2, 3, 8), "float32"), np.zeros((2, 8), "float32"), "float32")],
        schema=S.features_schema(meta))
    v1 = store.append(str(tmp_path), store.FEATURES, mk("a"), meta=meta)
    store.tag(str(tmp_path), store.FEATURES, "first", v1)
    store.append(str(tmp_path), store.FEATURES, mk("b"), meta=meta)
    assert store.read(str(tmp_path), store.FEATURES, version=v1).num_rows == 1
    assert store.read(str(tmp_path), store.FEATURES, version="first").num_rows == 1
    assert store.sample_ids(str(tmp_path), store.FEATURES) == {"a", "b"}
    with pytest.raises(StoreError, match=r"has no version 99 \(the latest is 3;"):
        store.read(str(tmp_path), store.FEATURES, version=99)
    with pytest.raises(StoreError, match=r"has no tag 'second' \(tags: first;"):
        store.read(str(tmp_path), store.FEATURES, version="second")
