"""A tiny target directory and a small features table for the interop tests (no vLLM)."""

import json

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file

import fs_helpers as H
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import source, specforge
from eaglenest.featurestore.table import store

VOCAB, HIDDEN, LAYERS = 64, 8, 8


def tiny_target(path, seed=0):
    """config.json + model.safetensors holding the embedding and a final norm (what interop reads)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    g = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "model.norm.weight": torch.rand(HIDDEN, generator=g) + 0.5}, str(path / "model.safetensors"))
    return str(path)


def rows(ids, m, *, seed=0):
    """fs_helpers rows in any table dtype (bf16 as its bit patterns)."""
    out = H.rows(ids, H.meta(), seed=seed)
    for r in out:
        T = r["num_tokens"]
        aux = torch.from_numpy(S.decode_tensor(r["aux_hidden"], (T, 3, HIDDEN), "float32").copy())
        last = torch.from_numpy(S.decode_tensor(r["last_hidden"], (T, HIDDEN), "float32").copy())
        dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[m.dtype]
        r["aux_hidden"] = S.encode_value(S.to_numpy(aux.to(dt)), m)
        r["last_hidden"] = S.encode_value(S.to_numpy(last.to(dt)), m)
    return out


def make_table(uri, target, *, dtype="float32", name="features", n=5, storage="raw"):
    import dataclasses

    from eaglenest.featurestore.capture.identity import weights_hash

    comps = json.dumps({"target": target, "weights_sha256": weights_hash(target)}, sort_keys=True)
    m = dataclasses.replace(H.meta(dtype=dtype, target=target), storage=storage, identity=comps)
    table = pa.Table.from_pylist(rows([f"d-{k:02d}" for k in range(n)], m), schema=S.features_schema(m))
    store.append(uri, name, table, meta=m)
    return m


def table_rows(uri, name):
    return sorted(store.read(uri, name).to_pylist(), key=lambda r: r["sample_id"])


def assert_same_rows(uri, a, b):
    ra, rb = table_rows(uri, a), table_rows(uri, b)
    assert [r["sample_id"] for r in ra] == [r["sample_id"] for r in rb]
    for x, y in zip(ra, rb):
        assert x == y  # every column, tensor bytes included


def versions(uri, name):
    return store.latest_version(uri, name) if store.exists(uri, name) else None


@pytest.fixture
def base(tmp_path):
    """A 5-sample float32 table (and its tiny target) in a local store: ``(uri, target, tmp_path)``."""
    target = tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    make_table(uri, target)
    return uri, target, tmp_path


def nan_dump(base):
    """A SpecForge export of the ``base`` table whose fifth sample holds NaN (an import refuses it after
    four rows are written)."""
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    path = next((tmp / "sf").rglob("data_4.ckpt"))
    d = torch.load(path, weights_only=True)
    torch.save({**d, "aux_hidden_state": d["aux_hidden_state"] * float("nan")}, path)
    return tmp / "sf"
