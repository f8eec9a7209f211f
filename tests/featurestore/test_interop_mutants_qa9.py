"""The hub's second mutation audit: what each peer's files hold, checked from the formats' definitions
(not by a round trip through eaglenest's own reader, which a symmetric slip on both sides passes):
speculators' ``hs_<i>`` (token_ids int64, the aux layers ascending then the last layer) and dataset rows,
SpecForge's layer-major ``aux_hidden_state``, loss masks position for position with their tokens (no
shift: each peer shifts in its trainer), a foreign dump's rows taken as the files hold them, foreign
sample ids as ``<domain>-<sha256 of the int32 token ids>[:16]``, and the hf export's column features."""

from __future__ import annotations

import hashlib
import json

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.interop.source import EXPORT_RECORD, SAMPLES
from eaglenest.featurestore.table import store

N_AUX = 3


def _by_id(uri, name="features"):
    return {r["sample_id"]: r for r in I.table_rows(uri, name)}


def _tensors(r, dtype="float32"):
    T = r["num_tokens"]
    return (S.torch_from_blob(r["aux_hidden"], (T, N_AUX, I.HIDDEN), dtype),
            S.torch_from_blob(r["last_hidden"], (T, I.HIDDEN), dtype))


def _lines(out):
    return [json.loads(x) for x in (out / SAMPLES).read_text().splitlines()]


def _foreign(out):
    """Make an eaglenest export a peer's own dump: no record, no sample lines."""
    (out / EXPORT_RECORD).unlink()
    (out / SAMPLES).unlink()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculators_files_hold_the_aux_layers_ascending_then_the_last(tmp_path, dtype):
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target, dtype=dtype)
    out = tmp_path / "out"
    speculators.export(source.open_source(uri, "features"), out, target=target)
    rows, data = _by_id(uri), datasets.load_from_disk(str(out)).with_format(None)
    for i, line in enumerate(_lines(out)):
        r, hs = rows[line["sample_id"]], load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        aux, last = _tensors(r, dtype)
        T = r["num_tokens"]
        assert hs["token_ids"].dtype == torch.int64 and hs["token_ids"].tolist() == r["input_ids"]
        assert hs["hidden_states"].shape == (T, N_AUX + 1, I.HIDDEN) and hs["hidden_states"].dtype == aux.dtype
        for k in range(N_AUX):  # layer_ids (2, 4, 5): slot k is the k-th smallest
            assert torch.equal(hs["hidden_states"][:, k], aux[:, k]), k
        assert torch.equal(hs["hidden_states"][:, N_AUX], last)
        assert data[i] == {"input_ids": r["input_ids"], "loss_mask": r["loss_mask"], "seq_len": T}
    assert data.features["input_ids"].feature.dtype == "int64" == data.features["loss_mask"].feature.dtype
    record = json.loads((out / EXPORT_RECORD).read_text())  # what --target-layer-ids takes, and each file's slots
    assert record["speculators_target_layer_ids"] == [2, 4, 5] == record["layer_ids_vllm"]
    assert record["hidden_states_layers_vllm"] == [2, 4, 5, I.LAYERS]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_specforge_files_hold_layer_major_aux_and_unshifted_masks(tmp_path, dtype):
    target = I.tiny_target(tmp_path / "target")
    uri, tmp = str(tmp_path / "store"), tmp_path
    I.make_table(uri, target, dtype=dtype)
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    rows = _by_id(uri)
    weight, eps = specforge.final_norm(target)
    for line in _lines(tmp / "sf"):
        r, d = rows[line["sample_id"]], torch.load(tmp / "sf" / line["file"], weights_only=True)
        aux, last = _tensors(r, dtype)
        assert d["input_ids"].dtype == torch.int64 and d["input_ids"].tolist() == r["input_ids"]
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == r["loss_mask"]
        flat = d["aux_hidden_state"][0]  # SGLang concatenates the captured layers: [T, layer 0's H | layer 1's H | ...]
        for k in range(N_AUX):
            assert torch.equal(flat[:, k * I.HIDDEN:(k + 1) * I.HIDDEN], aux[:, k]), k
        x = last.double()  # the final RMSNorm, in float64, from its definition
        want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        if dtype == "bfloat16":  # computed wide, rounded once (not a bf16 chain of roundings)
            assert torch.equal(d["hidden_state"][0], want.to(torch.bfloat16))
        else:
            assert torch.allclose(d["hidden_state"][0].double(), want, rtol=1e-6, atol=1e-7)
        assert torch.equal(d[specforge.PRENORM_KEY][0], last)


@pytest.mark.parametrize("module", [speculators, specforge])
def test_a_foreign_dump_comes_in_as_its_files_hold_it(base, module):
    """No record: the rows are the files' (aux order, last layer, masks unshifted), the recipe's layers
    (given in any order) stored ascending, and each sample id the documented content hash."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "dump", target=target)
    _foreign(tmp / "dump")  # (SpecForge's files keep the unnormed state: an exact import)
    summary = module.import_dump(tmp / "dump", uri, "foreign", target=target, layer_ids=[5, 2, 4], domain="peer")
    assert summary["layer_ids"] == [2, 4, 5] and summary["rows"] == 5
    meta = S.feature_meta(store.dataset(uri, "foreign").schema)  # the last layer is vLLM id L (L = num layers)
    assert meta.last_layer_id == I.LAYERS == meta.identity_components["last_layer_id"]
    want = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "features")}
    got = I.table_rows(uri, "foreign")
    assert sorted(tuple(r["input_ids"]) for r in got) == sorted(want)
    for r in got:
        o = want[tuple(r["input_ids"])]
        assert r["loss_mask"] == o["loss_mask"] and r["num_loss_tokens"] == sum(o["loss_mask"])
        assert r["aux_hidden"] == o["aux_hidden"] and r["last_hidden"] == o["last_hidden"]
        digest = hashlib.sha256(np.asarray(r["input_ids"], dtype="<i4").tobytes()).hexdigest()[:16]
        assert r["sample_id"] == f"peer-{digest}" and r["split"] == "train"


def test_a_foreign_dump_whose_masks_differ_by_row_keeps_each_rows_mask(base):
    """Masks with zeros inside (not all-ones): an inverted or shifted mask would show."""
    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "dump", target=target)
    data = datasets.load_from_disk(str(tmp / "dump")).with_format(None)
    masks = [[(j + i) % 3 != 0 for j in range(len(row["input_ids"]))] for i, row in enumerate(data)]
    edited = data.map(lambda row, i: {"loss_mask": [int(b) for b in masks[i]]}, with_indices=True)
    edited.save_to_disk(str(tmp / "edited"))
    (tmp / "edited" / "hidden_states").symlink_to(tmp / "dump" / "hidden_states")
    speculators.import_dump(tmp / "edited", uri, "foreign", target=target, layer_ids=[2, 4, 5])
    got = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "foreign")}
    for row, mask in zip(data, masks):
        r = got[tuple(row["input_ids"])]
        assert r["loss_mask"] == [int(b) for b in mask] and r["num_loss_tokens"] == sum(mask)


def test_hf_export_columns_have_the_documented_features(base):
    uri, _, tmp = base
    hf.export(source.open_source(uri, "features"), tmp / "hf", with_tensors=True)
    f = datasets.load_from_disk(str(tmp / "hf")).features
    assert {k: f[k].dtype for k in ("num_tokens", "num_loss_tokens")} == {"num_tokens": "int32",
                                                                        "num_loss_tokens": "int32"}
    assert f["input_ids"].feature.dtype == "int32" and f["loss_mask"].feature.dtype == "uint8"
    assert f["aux_hidden"] == datasets.Array3D(shape=(None, N_AUX, I.HIDDEN), dtype="float32")
    assert f["last_hidden"] == datasets.Array2D(shape=(None, I.HIDDEN), dtype="float32")


@pytest.mark.parametrize("i, want", [(0, "rows_0-2000/data_0.ckpt"), (1999, "rows_0-2000/data_1999.ckpt"),
                                     (2000, "rows_2000-4000/data_2000.ckpt"), (4001, "rows_4000-6000/data_4001.ckpt")])
def test_specforge_files_are_grouped_as_prepare_hidden_states_groups_them(i, want):
    """``rows_<g>-<g+2000>/data_<i>.ckpt`` with ``g = i // 2000 * 2000`` (SpecForge's own folders)."""
    assert specforge._rel(i) == want
