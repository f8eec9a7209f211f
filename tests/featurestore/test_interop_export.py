"""Export to speculators / SpecForge and import back: bit-exact round trips, the peers' own loaders
(where the peer installs: speculators and SpecForge's offline reader, skipped otherwise), the
vocabulary mapping against the trainer's rule, and the SpecForge final-norm convention."""

import importlib
import json

import numpy as np
import pytest
import torch

import interop_helpers as I
from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import source, specforge, speculators
from eaglenest.featurestore.table import store


@pytest.fixture
def setup(tmp_path):
    target = I.tiny_target(tmp_path / "target")
    return str(tmp_path / "store"), target, tmp_path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("peer", [speculators, specforge])
def test_round_trip_is_bit_exact(setup, peer, dtype):
    uri, target, tmp = setup
    m = I.make_table(uri, target, dtype=dtype)
    src = source.open_source(uri, "features")
    record = peer.export(src, tmp / "out", draft_vocab_size=16, target=target)
    assert record["table_version"] == src.version and record["layer_ids_vllm"] == [2, 4, 5]
    prov = json.loads((tmp / "out" / "provenance.json").read_text())
    assert prov["inputs"]["table_version"] == src.version
    assert not list(tmp.glob(".out.partial-*"))  # built aside, renamed into place
    # speculators' dataset is generated through a datasets cache inside the export: it is not shipped
    assert sorted(p.name for p in (tmp / "out").iterdir() if p.name.startswith(".")) == []
    summary = peer.import_dump(tmp / "out", uri, "back", target=target)
    assert summary["rows"] == 5 and summary["version"] == 2
    I.assert_same_rows(uri, "features", "back")
    assert S.feature_meta(store.dataset(uri, "back").schema) == m


def test_export_refuses_an_existing_out(setup):
    uri, target, tmp = setup
    I.make_table(uri, target)
    (tmp / "out").mkdir()
    (tmp / "out" / "x").write_text("keep")
    with pytest.raises(ConfigError, match=r"^--out .*out: exists and is not an empty directory"):
        speculators.export(source.open_source(uri, "features"), tmp / "out")
    assert (tmp / "out" / "x").read_text() == "keep"


def test_vocab_mapping_is_the_trainers_rule(setup):
    from eaglenest.train.vocab import select_vocab

    uri, target, tmp = setup
    I.make_table(uri, target)
    speculators.export(source.open_source(uri, "features"), tmp / "out", draft_vocab_size=16, target=target)
    d2t, t2d = np.load(tmp / "out" / "d2t-16.npy"), np.load(tmp / "out" / "t2d-16.npy")
    counts = np.zeros(I.VOCAB, dtype=np.int64)
    for r in I.table_rows(uri, "features"):
        ids, mask = np.asarray(r["input_ids"]), np.asarray(r["loss_mask"]).astype(bool)
        np.add.at(counts, ids[mask], 1)
    want = select_vocab(counts, 16)
    assert np.array_equal(d2t, want.d2t.numpy()) and np.array_equal(t2d, want.t2d.numpy())
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (I.VOCAB,)


def test_speculators_own_loader_reads_the_export(setup):
    """speculators' ArrowDataset (its trainer's dataset) on the export: same tensors as the table."""
    data = importlib.import_module("speculators.train.data")  # installed by `make install` (Makefile)
    uri, target, tmp = setup
    m = I.make_table(uri, target, dtype="bfloat16")
    speculators.export(source.open_source(uri, "features"), tmp / "out", draft_vocab_size=16, target=target)
    ds = data.ArrowDataset(max_len=64, datapath=str(tmp / "out"), on_missing="raise")
    lines = [json.loads(x) for x in (tmp / "out" / "eaglenest_samples.jsonl").read_text().splitlines()]
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    assert len(ds) == len(rows)
    for i in range(len(ds)):
        got, r = ds[i], rows[lines[i]["sample_id"]]
        T = r["num_tokens"]
        aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), m.dtype)
        last = S.torch_from_blob(r["last_hidden"], (T, m.hidden_size), m.dtype)
        assert torch.equal(got["hidden_states"], aux.reshape(T, -1))
        assert torch.equal(got["verifier_last_hidden_states"], last)
        assert got["input_ids"].tolist() == r["input_ids"] and got["loss_mask"].tolist() == r["loss_mask"]
    d2t, t2d = np.load(tmp / "out" / "d2t-16.npy"), np.load(tmp / "out" / "t2d-16.npy")
    from speculators.train.cli import _load_mappings

    assert _load_mappings(tmp / "out" / "d2t-16.npy", tmp / "out" / "t2d-16.npy", 16)[2] == 16
    assert int(t2d.sum()) == 16 == d2t.shape[0]


def test_specforge_own_reader_reads_the_export(setup):
    """SpecForge's OfflineManifestReader + LocalFeatureStore + EAGLE-3 offline normalizer on the export."""
    reader = importlib.import_module("specforge.runtime.data_plane.offline_reader")  # `make install`
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    uri, target, tmp = setup
    m = I.make_table(uri, target)
    specforge.export(source.open_source(uri, "features"), tmp / "out", draft_vocab_size=16, target=target)
    by_file = {x["file"]: x["sample_id"]
               for x in map(json.loads, (tmp / "out" / "eaglenest_samples.jsonl").read_text().splitlines())}
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    weight, eps = specforge.final_norm(target)
    fs = LocalFeatureStore()
    refs = reader.OfflineManifestReader(str(tmp / "out"), validate_files=True).read()
    assert len(refs) == len(rows)
    for ref in refs:
        raw, handle = fs.get(ref)
        fs.release(handle)
        rel = ref.feature_store_uri.split(str(tmp / "out") + "/", 1)[1]
        r = rows[by_file[rel]]
        T = r["num_tokens"]
        out = normalize_offline_sample(raw, max_len=64)
        aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), m.dtype)
        last = S.torch_from_blob(r["last_hidden"], (T, m.hidden_size), m.dtype)
        assert torch.equal(out["hidden_state"][0], aux.reshape(T, -1))
        assert torch.allclose(out["target"][0], specforge.apply_norm(last, weight, eps))
        assert out["input_ids"][0].tolist() == r["input_ids"]
    mapping = torch.load(tmp / "out" / "vocab_mapping.pt", weights_only=True)
    assert mapping["d2t"].shape == (16,) and int(mapping["t2d"].sum()) == 16


def test_specforge_hidden_state_is_after_the_final_norm(setup):
    """hidden_state = RMSNorm(last) * w, and a foreign dump (no unnormed copy) imports to a tensor
    whose final norm is SpecForge's hidden_state (the logits the trainer computes are the same)."""
    uri, target, tmp = setup
    I.make_table(uri, target)
    specforge.export(source.open_source(uri, "features"), tmp / "out", target=target)
    weight, eps = specforge.final_norm(target)
    for p in sorted((tmp / "out").rglob("*.ckpt")):  # make it a foreign dump
        d = torch.load(p, weights_only=True)
        x = d.pop(specforge.PRENORM_KEY)[0]
        assert torch.allclose(d["hidden_state"][0], torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps))
        torch.save(d, p)
    for f in ("eaglenest_export.json", "eaglenest_samples.jsonl"):
        (tmp / "out" / f).unlink()
    summary = specforge.import_dump(tmp / "out", uri, "foreign", target=target, layer_ids=[2, 4, 5], domain="sf")
    assert summary["last_hidden_exact"] is False and summary["layer_ids"] == [2, 4, 5] and summary["rows"] == 5
    orig = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "features")}
    foreign = I.table_rows(uri, "foreign")
    assert sorted(tuple(r["input_ids"]) for r in foreign) == sorted(orig)  # every sample, each once
    for r in foreign:
        o, T = orig[tuple(r["input_ids"])], r["num_tokens"]
        assert r["sample_id"].startswith("sf-") and r["aux_hidden"] == o["aux_hidden"]
        got = S.torch_from_blob(r["last_hidden"], (T, I.HIDDEN), "float32")
        want = S.torch_from_blob(o["last_hidden"], (T, I.HIDDEN), "float32")
        assert torch.allclose(specforge.apply_norm(got, weight, eps), specforge.apply_norm(want, weight, eps),
                              atol=1e-5)


def test_fp8_table_comes_back_dequantized_as_its_own_feature_set(setup):
    uri, target, tmp = setup
    m = I.make_table(uri, target, dtype="bfloat16", storage="fp8_e4m3")
    speculators.export(source.open_source(uri, "features"), tmp / "out", target=target)
    speculators.import_dump(tmp / "out", uri, "back", target=target)
    back = S.feature_meta(store.dataset(uri, "back").schema)
    assert back.storage == "raw" and back.dtype == "bfloat16" and back.feature_set_id != m.feature_set_id
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    got = I.table_rows(uri, "back")
    assert sorted(r["sample_id"] for r in got) == sorted(rows)
    for r in got:
        T = r["num_tokens"]
        for col, shape in (("aux_hidden", (T, 3, I.HIDDEN)), ("last_hidden", (T, I.HIDDEN))):
            want = S.decode_fp8(rows[r["sample_id"]][col], shape).to(torch.bfloat16)
            assert torch.equal(S.torch_from_blob(r[col], shape, "bfloat16"), want), col
