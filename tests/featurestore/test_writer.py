"""Bounded-memory capture writes: fragments every ``budget`` bytes, one atomic commit per chunk."""

import fs_helpers as H

from eaglenest.featurestore.table import fragments, store
from eaglenest.featurestore.capture.writer import FeatureWriter, bytes_per_token


def test_writer_flushes_fragments_and_commits_once(tmp_path):
    uri, m = str(tmp_path), H.meta()
    rows = H.rows([f"s{i}" for i in range(7)], m, num_tokens=4)
    rows[5]["domain"] = "other"
    one = len(rows[0]["aux_hidden"]) + len(rows[0]["last_hidden"])
    w = FeatureWriter(uri, "features", m, budget=2 * one)  # a fragment every two rows
    for r in rows:
        w.add(r)
    assert w.fragments_written == 3  # six rows written as three fragments, the seventh buffered
    assert store.sample_ids(uri, "features") == set()  # written, not committed: invisible
    version = w.commit({"manifest": "m"})
    assert w.fragments_written == 4
    ds = store.dataset(uri, "features")
    assert ds.version == version and len(ds.get_fragments()) == 4
    got = store.read(uri, "features", columns=["sample_id", "aux_hidden"])
    assert got.column("sample_id").to_pylist() == [r["sample_id"] for r in rows]
    assert got.column("aux_hidden").to_pylist() == [r["aux_hidden"] for r in rows]
    lineage = fragments.lineage_of(ds, version)
    assert lineage["counts_per_domain"] == {"d": 6, "other": 1} and lineage["manifest"] == "m"
    assert w.commit() is None  # nothing buffered: no empty commit


def test_uncommitted_fragments_stay_invisible(tmp_path):
    uri, m = str(tmp_path), H.meta()
    rows = H.rows(["a", "b", "c"], m)
    killed = FeatureWriter(uri, "features", m, budget=1)  # every row is written at once
    for r in rows:
        killed.add(r)
    assert killed.fragments_written == 3
    # The run dies before commit: readers and a resumed run see no row of it.
    assert store.sample_ids(uri, "features") == set()
    again = FeatureWriter(uri, "features", m, budget=1 << 20)
    for r in rows:
        again.add(r)
    again.commit()
    assert sorted(store.read(uri, "features", columns=["sample_id"]).column("sample_id").to_pylist()) == ["a", "b", "c"]


def test_bytes_per_token_counts_aux_and_last_layers():
    m = H.meta(dtype="bfloat16", hidden=8)
    assert bytes_per_token(m) == (len(m.layer_ids) + 1) * 8 * 2
