"""Round trips store -> peer format -> store over rows that differ in every column (domains, splits,
modes, sources, gen params, loss masks with zeros inside, lengths), for each peer, table dtype and
storage: the rows come back with their own columns, not a neighbour's, and the tensors bit for bit
(``fp8_e4m3``: dequantized, as docs/export.md says). The helpers' rows share their string columns
and mask shape, so a mix-up between rows would not show there. Also: a foreign dump's table trains
every draft family."""

import dataclasses
import json

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

import interop_helpers as I
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.identity import weights_hash
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.table import store

STRINGS = ("sample_id", "domain", "source", "split", "mode", "gen_params_id")
TOKENS = ("num_tokens", "num_loss_tokens", "input_ids", "loss_mask")


def varied_table(uri, target, *, dtype, storage, n=6):
    """A table whose rows differ in every string column and in their loss masks."""
    comps = json.dumps({"target": target, "weights_sha256": weights_hash(target)}, sort_keys=True)
    m = dataclasses.replace(I.H.meta(dtype=dtype, target=target), storage=storage, identity=comps)
    rows = I.rows([f"x-{k:02d}" for k in range(n)], m)
    for k, r in enumerate(rows):
        mask = [int(b) for b in np.random.default_rng(k).integers(0, 2, r["num_tokens"])]
        mask[k % r["num_tokens"]] = 1 - mask[k % r["num_tokens"]]
        r.update(domain=("math", "code", "chat")[k % 3], split=("train", "eval")[k % 2],
                 mode=("chat", "completion")[k % 2], source=f"pool-{k}.jsonl", gen_params_id=f"gp{k}",
                 loss_mask=mask, num_loss_tokens=sum(mask))
    store.append(uri, "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    assert len({(r["domain"], r["split"], tuple(r["loss_mask"])) for r in rows}) == n  # all differ
    return m


def tensors(row, m):
    T = row["num_tokens"]
    shapes = {"aux_hidden": (T, len(m.layer_ids), m.hidden_size), "last_hidden": (T, m.hidden_size)}
    if m.storage == "fp8_e4m3":
        return {c: S.decode_fp8(row[c], s).to(source.torch_dtype(m.dtype)) for c, s in shapes.items()}
    return {c: S.torch_from_blob(row[c], s, m.dtype) for c, s in shapes.items()}


@pytest.mark.parametrize("dtype, storage", [("float32", "raw"), ("float16", "raw"), ("bfloat16", "raw"),
                                            ("bfloat16", "fp8_e4m3"), ("float16", "fp8_e4m3")])
@pytest.mark.parametrize("peer", [speculators, specforge])
def test_every_column_comes_back_to_its_own_row(tmp_path, peer, dtype, storage):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    m = varied_table(uri, target, dtype=dtype, storage=storage)
    peer.export(source.open_source(uri, "features"), tmp_path / "out", draft_vocab_size=8, target=target)
    summary = peer.import_dump(tmp_path / "out", uri, "back", target=target)
    want, got = I.table_rows(uri, "features"), I.table_rows(uri, "back")
    assert summary["rows"] == len(want) == len(got) == 6
    back = S.feature_meta(store.dataset(uri, "back").schema)
    assert (back.dtype, back.storage, back.layer_ids) == (dtype, "raw", m.layer_ids)
    for w, g in zip(want, got, strict=True):
        assert {k: g[k] for k in STRINGS + TOKENS} == {k: w[k] for k in STRINGS + TOKENS}
        for col, t in tensors(w, m).items():
            assert torch.equal(tensors(g, back)[col], t), (w["sample_id"], col)


@pytest.mark.parametrize("dtype, storage", [("float16", "raw"), ("bfloat16", "raw"), ("float32", "fp8_e4m3")])
def test_hf_export_keeps_every_row_its_own_columns(tmp_path, dtype, storage):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    m = varied_table(uri, target, dtype=dtype, storage=storage)
    hf.export(source.open_source(uri, "features"), tmp_path / "hf", with_tensors=True)
    ds = datasets.load_from_disk(str(tmp_path / "hf")).with_format("numpy")
    want = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    assert len(ds) == len(want) == 6
    for g in ds:
        w = want[str(g["sample_id"])]
        assert {k: str(g[k]) for k in STRINGS} == {k: w[k] for k in STRINGS}
        assert g["input_ids"].tolist() == w["input_ids"] and g["loss_mask"].tolist() == w["loss_mask"]
        assert int(g["num_loss_tokens"]) == sum(w["loss_mask"])
        for col, t in tensors(w, m).items():
            assert torch.equal(torch.from_numpy(np.asarray(g[col])).to(t.dtype), t), (w["sample_id"], col)


# -- a foreign dump's table trains every draft family (EAGLE-3, P-EAGLE, DFlash read the same tables) ----

def _foreign_dump(peer, uri, target, out):
    """``peer``'s export of the table, stripped to what the peer itself writes (no eaglenest files)."""
    peer.export(source.open_source(uri, "features"), out, target=target)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
        (out / f).unlink()
    for p in out.rglob("*.ckpt"):
        d = torch.load(p, weights_only=True)
        del d[specforge.PRENORM_KEY]
        torch.save(d, p)


@pytest.mark.slow
@pytest.mark.parametrize("peer", [speculators, specforge])
def test_an_imported_foreign_dump_trains_every_family(tmp_path, tiny_target, peer):
    from eaglenest.featurestore.config import FeaturestoreConfig
    from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig
    from eaglenest.train.loop import train

    target, H = str(tiny_target), 128
    comps = json.dumps({"target": target, "weights_sha256": weights_hash(target)}, sort_keys=True)
    m = S.FeatureMeta(target=target, layer_ids=(2, 4, 5), last_layer_id=8, hidden_size=H, dtype="float32",
                      identity=comps)
    g, rows = np.random.default_rng(0), []
    for k in range(6):
        T = 24 + k
        rows.append(dict(sample_id=f"s-{k}", domain="d", source="t", split="train", mode="chat", gen_params_id="g",
                         num_tokens=T, num_loss_tokens=T - 8, input_ids=g.integers(3, 2000, T).tolist(),
                         loss_mask=[0] * 8 + [1] * (T - 8),
                         aux_hidden=S.encode_tensor(g.standard_normal((T, 3, H)).astype("<f4"), "float32"),
                         last_hidden=S.encode_tensor(g.standard_normal((T, H)).astype("<f4"), "float32")))
    uri = str(tmp_path / "store")
    store.append(uri, "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    _foreign_dump(peer, uri, target, tmp_path / "dump")
    assert peer.import_dump(tmp_path / "dump", uri, "imported", target=target, layer_ids=[2, 4, 5])["rows"] == 6
    fast = dict(draft_vocab_size=512, pack_tokens=128, batch_rows=2, warmup_steps=1, log_every_steps=1, lr=5e-3)
    for family, extra in (("eagle3", {}), ("peagle", {"peagle": PEagleConfig(num_slots=2, anchors_per_row=8)}),
                          ("dflash", {"dflash": DFlashConfig(num_layers=1, block_size=3, anchors_per_row=8)})):
        summary = train(TrainConfig(family=family, **fast, **extra), store_uri=uri, workdir=str(tmp_path / family),
                        target_dir=target, seed=0, argv=["test"], featurestore=FeaturestoreConfig(table="imported"))
        lines = [json.loads(x) for x in (summary.outdir / "metrics.jsonl").read_text().splitlines()]
        assert lines and all(np.isfinite(x["loss"]) for x in lines), (family, lines[:2])
        assert (summary.outdir / "checkpoint.json").is_file(), family
