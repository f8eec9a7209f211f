"""The hub's converters held to first principles where a mutation audit found them unchecked: the
draft vocabulary when the loss tokens are fewer than the draft (the fill, against speculators' own
rule), speculators' ``seq_len`` column, SpecForge's layer ids in the record (against SpecForge's own
default), first-pass refusals (a hidden-state file of fewer tokens than its row, a loss mask that is not
0/1, a token id equal to the vocabulary size), a foreign SpecForge dump's rows in index order past ten
files, one whose files keep the unnormed state only in part, and an hf export over several shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest.errors import SchemaError
from eaglenest.featurestore.interop import source, specforge, speculators
from eaglenest.featurestore.table import store


def test_vocab_fill_is_speculators_rule_when_few_tokens_are_seen(base):
    """A draft vocabulary larger than the loss tokens seen: the rest is the smallest unseen ids, 0
    included (speculators' ``build_vocab_mappings_from_distribution`` and the trainer's ``select_vocab``)."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    from eaglenest.train.vocab import select_vocab

    counts = {5: 3, 9: 3, 40: 7, 63: 1}
    for draft in (4, 6, 12, 64):
        d2t, t2d = source.vocab_mapping(counts, draft, I.VOCAB)
        want_d2t, want_t2d = build_vocab_mappings_from_distribution(counts, draft, I.VOCAB)
        assert np.array_equal(d2t, want_d2t.numpy()) and np.array_equal(t2d, want_t2d.numpy())
        dense = np.zeros(I.VOCAB, dtype=np.int64)
        dense[list(counts)] = list(counts.values())
        assert np.array_equal(d2t, select_vocab(dense, draft).d2t.numpy())
        ids = np.arange(draft) + d2t  # target id = draft id + d2t[draft id]
        assert set(ids[t2d[ids]]) == set(ids) and int(t2d.sum()) == draft
        assert set(counts) <= set(ids.tolist()) or draft < len(counts)
    assert 0 in (np.arange(6) + source.vocab_mapping(counts, 6, I.VOCAB)[0]).tolist()


def test_speculators_seq_len_is_each_rows_token_count(base):
    """speculators' trainer batches by ``seq_len`` (``_compute_approx_lengths``): it is the row's tokens."""
    import datasets

    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "sp", target=target)
    ds = datasets.load_from_disk(str(tmp / "sp")).with_format(None)
    rows = {r["sample_id"]: r for r in I.table_rows(uri, "features")}
    lines = [line for line in (tmp / "sp" / source.SAMPLES).read_text().splitlines() if line]
    assert len(ds) == len(rows) == len(lines)
    for i, line in enumerate(lines):
        row = rows[json.loads(line)["sample_id"]]
        assert ds[i]["seq_len"] == len(ds[i]["input_ids"]) == row["num_tokens"]
        assert ds[i]["input_ids"] == row["input_ids"] and ds[i]["loss_mask"] == row["loss_mask"]


def test_speculators_hidden_states_of_fewer_tokens_than_the_row_are_refused_first(base):
    """A file whose ``hidden_states`` lost its last token (its token_ids intact) is refused in the first
    pass with its shape, before a table is created."""
    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "sp", target=target)
    path = tmp / "sp" / "hidden_states" / "hs_3.safetensors"
    tensors = load_file(str(path))
    T = tensors["token_ids"].shape[0]
    save_file({**tensors, "hidden_states": tensors["hidden_states"][:-1].contiguous()}, str(path))
    with pytest.raises(SchemaError, match=rf"hs_3.safetensors: hidden_states shape \[{T - 1}, 4, 8\], "
                                          rf"expected \[{T}, n_aux \+ 1, H\]"):
        speculators.import_dump(tmp / "sp", uri, "back", target=target)
    assert I.versions(uri, "back") is None
    assert torch.equal(load_file(str(path))["token_ids"], tensors["token_ids"])


@pytest.mark.parametrize("bad", [2, -1])
def test_speculators_loss_mask_not_0_1_is_refused_first(base, bad):
    """A mask value of 2 (or -1, 255 once cast to uint8) is refused in the first pass, naming the row."""
    import datasets

    uri, target, tmp = base
    speculators.export(source.open_source(uri, "features"), tmp / "sp", target=target)
    ds = datasets.load_from_disk(str(tmp / "sp")).with_format(None)
    masks = [list(m) for m in ds["loss_mask"]]
    masks[2][-1] = bad
    ds = ds.remove_columns("loss_mask").add_column("loss_mask", masks)
    ds.save_to_disk(str(tmp / "sp2"))
    for extra in ("hidden_states", source.EXPORT_RECORD, source.SAMPLES):
        (tmp / "sp2" / extra).symlink_to(tmp / "sp" / extra)
    T = len(masks[2])
    with pytest.raises(SchemaError, match=rf"dataset row 2: loss_mask must be {T} values of 0/1"):
        speculators.import_dump(tmp / "sp2", uri, "back", target=target)
    assert I.versions(uri, "back") is None


def test_specforge_layer_ids_in_the_record_are_specforges_own_default(base):
    """The table's layers are vLLM's default for the 8-layer target, (2, 4, 5): the record names them as
    SpecForge's own default for that target resolves (``resolve_eagle_capture_layers``), the ids its
    ``aux_hidden_state_layer_ids`` takes."""
    from types import SimpleNamespace as N

    from specforge.algorithms.model_providers import resolve_eagle_capture_layers

    from eaglenest.featurestore.capture.engine import default_layer_ids

    uri, target, tmp = base
    src = source.open_source(uri, "features")
    assert src.meta.layer_ids == default_layer_ids(I.LAYERS)
    record = specforge.export(src, tmp / "sf", target=target)
    want = resolve_eagle_capture_layers(N(model=N(aux_hidden_state_layer_ids=None)), {},
                                        N(num_hidden_layers=I.LAYERS))
    assert record["specforge_aux_hidden_state_layer_ids"] == want
    assert json.loads((tmp / "sf" / source.EXPORT_RECORD).read_text())["specforge_aux_hidden_state_layer_ids"] == want
    assert record["layer_ids_vllm"] == list(default_layer_ids(I.LAYERS))


def test_specforge_foreign_rows_come_in_index_order_past_ten_files(tmp_path):
    """``data_10`` after ``data_9``, not after ``data_1`` (a name order): the table holds the dump's rows in
    the order SpecForge wrote them, the order of the table they were exported from."""
    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    I.make_table(uri, target, n=12)
    specforge.export(source.open_source(uri, "features"), tmp_path / "sf", target=target)
    for extra in (source.EXPORT_RECORD, source.SAMPLES):
        (tmp_path / "sf" / extra).unlink()
    specforge.import_dump(tmp_path / "sf", uri, "x", target=target, layer_ids=[2, 4, 5])
    want = [r["input_ids"] for r in store.read(uri, "features").to_pylist()]
    got = [r["input_ids"] for r in store.read(uri, "x").to_pylist()]
    assert len(set(map(tuple, want))) == 12 and got == want
    sources = [r["source"] for r in store.read(uri, "x").to_pylist()]
    assert [int(s.rsplit("data_", 1)[1].split(".")[0]) for s in sources] == list(range(12))


def _foreign_specforge(base, name: str = "sf"):
    """A SpecForge export of the ``base`` table with no eaglenest record or sample lines (a foreign dump)."""
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / name, target=target)
    for extra in (source.EXPORT_RECORD, source.SAMPLES):
        (tmp / name / extra).unlink()
    return tmp / name


def test_specforge_loss_mask_not_0_1_is_refused_first(base):
    uri, target, tmp = base
    dump = _foreign_specforge(base)
    path = next(dump.rglob("data_1.ckpt"))
    data = torch.load(path, weights_only=True)
    data["loss_mask"][-1] = 2
    torch.save(data, path)
    with pytest.raises(SchemaError, match=r"data_1.ckpt: loss_mask holds values other than 0/1"):
        specforge.import_dump(dump, uri, "x", target=target, layer_ids=[2, 4, 5])
    assert I.versions(uri, "x") is None


def test_specforge_dump_where_only_some_files_keep_the_unnormed_state(base):
    """Only the last file holds ``eaglenest_last_hidden``: every row is recovered from ``hidden_state`` and
    the final-norm weight alike, and the summary says the last layer is not exact."""
    uri, target, tmp = base
    dump = _foreign_specforge(base)
    files = sorted(dump.rglob("data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    normed = {}
    for path in files[:-1]:
        data = torch.load(path, weights_only=True)
        data.pop(specforge.PRENORM_KEY)
        torch.save(data, path)
    for path in files:
        data = torch.load(path, weights_only=True)
        normed[tuple(data["input_ids"].tolist())] = data["hidden_state"][0]
    summary = specforge.import_dump(dump, uri, "x", target=target, layer_ids=[2, 4, 5])
    assert summary["rows"] == 5 and summary["last_hidden_exact"] is False
    weight, eps = specforge.final_norm(target)
    for r in store.read(uri, "x").to_pylist():
        T = r["num_tokens"]
        last = torch.frombuffer(bytearray(r["last_hidden"]), dtype=torch.float32).reshape(T, I.HIDDEN)
        assert torch.equal(last, normed[tuple(r["input_ids"])] / weight)  # hidden_state / w, every row
        assert torch.allclose(specforge.apply_norm(last, weight, eps), normed[tuple(r["input_ids"])], atol=1e-4)


@pytest.mark.parametrize("module", [speculators, specforge])
def test_a_token_id_equal_to_the_vocabulary_size_is_refused(base, module):
    """Ids are 0..vocab_size - 1: ``vocab_size`` itself is one past the embedding (off by one)."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "d", target=target)
    if module is specforge:
        path = next((tmp / "d").rglob("data_0.ckpt"))
        data = torch.load(path, weights_only=True)
        data["input_ids"][0] = I.VOCAB
        torch.save(data, path)
    else:
        import datasets

        ds = datasets.load_from_disk(str(tmp / "d")).with_format(None)
        ids = [list(x) for x in ds["input_ids"]]
        ids[0][0] = I.VOCAB
        ds.remove_columns("input_ids").add_column("input_ids", ids).save_to_disk(str(tmp / "d2"))
        for extra in ("hidden_states", source.EXPORT_RECORD, source.SAMPLES):
            (tmp / "d2" / extra).symlink_to(tmp / "d" / extra)
    with pytest.raises(SchemaError, match=rf"token id {I.VOCAB} is outside the target's vocabulary "
                                          rf"\(0\.\.{I.VOCAB - 1}\)"):
        module.import_dump(tmp / ("d" if module is specforge else "d2"), uri, "x", target=target)
    assert I.versions(uri, "x") is None


def test_hf_export_over_several_shards_keeps_the_table_order(tmp_path):
    """Shards past ``max_shard_size`` are named in the order written: ``load_from_disk`` gives the rows in
    table order, each with its own tensors."""
    import datasets

    from eaglenest.featurestore.interop import hf

    target = I.tiny_target(tmp_path / "target")
    uri = str(tmp_path / "store")
    m = I.make_table(uri, target, n=12)
    hf.export(source.open_source(uri, "features"), tmp_path / "hf", with_tensors=True, max_shard_size="1KB")
    assert len(list((tmp_path / "hf").glob("data-*.arrow"))) > 3
    ds = datasets.load_from_disk(str(tmp_path / "hf"))
    rows = store.read(uri, "features").to_pylist()
    assert ds["sample_id"] == [r["sample_id"] for r in rows]
    for got, r in zip(ds, rows):
        T = r["num_tokens"]
        last = torch.frombuffer(bytearray(r["last_hidden"]), dtype=torch.float32).reshape(T, m.hidden_size)
        assert got["input_ids"] == r["input_ids"] and torch.equal(torch.tensor(got["last_hidden"]), last)
