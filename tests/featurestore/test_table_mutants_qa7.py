"""Mutation audit of the feature store's tables and reads (qa7): behaviours no earlier test pinned,
each checked from first principles (a round trip, an invariant, an independent reference)."""

from __future__ import annotations

import os
import time
import zlib

import numpy as np
import pytest

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import fragments, integrity, maintenance, store, versions

import fs_helpers as H  # on sys.path via conftest


def _append(uri, ids, m, **lineage):
    return store.append(uri, store.FEATURES, H.table(ids, m), meta=m, lineage=lineage or None)


def test_a_second_gc_keeps_the_lineage_the_first_gc_kept(tmp_path):
    """gc keeps the lineage of the versions it removes (the on-policy guard reads which target made
    them); a later gc adds the versions it removes to that record, never dropping earlier ones."""
    uri, m = str(tmp_path / "store"), H.meta()
    v_a = _append(uri, ["a0", "a1"], m, target="A", manifest_hash="ha")
    _append(uri, ["a2"], m, target="A", manifest_hash="hb")
    maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    first = fragments.removed_lineage(uri, store.FEATURES)
    assert first[v_a]["target"] == "A" and first[v_a]["manifest_hash"] == "ha"
    v_b = _append(uri, ["b0"], m, target="B", manifest_hash="hc")
    _append(uri, ["b1"], m, target="B", manifest_hash="hd")
    maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    kept = fragments.removed_lineage(uri, store.FEATURES)
    assert kept[v_a] == first[v_a]  # the first gc's record survives the second
    assert kept[v_b]["target"] == "B" and kept[v_b]["parent_version"] == v_b - 1
    assert set(first) < set(kept)


def test_an_uncommitted_fragment_inside_the_grace_period_is_kept(tmp_path):
    """``--grace-hours`` counts hours: a data file written 40 minutes ago and never committed is kept
    by a grace of one hour and swept by a grace of half an hour (its age set with utime)."""
    uri, m = str(tmp_path / "store"), H.meta()
    _append(uri, ["a0"], m)
    frags = fragments.write_fragment(uri, store.FEATURES, H.table(["u0"], m), meta=m)
    data = store.table_path(uri, store.FEATURES) / "data"
    (loose,) = [data / df.path for f in frags for df in f.files]
    forty_min_ago = time.time() - 40 * 60
    os.utime(loose, (forty_min_ago, forty_min_ago))
    kept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert kept["uncommitted_files_removed"] == 0 and loose.exists()
    swept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0.5)
    assert swept["uncommitted_files_removed"] == 1 and not loose.exists()
    assert store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist() == ["a0"]


def test_a_flipped_byte_in_the_first_block_of_a_large_data_file_is_caught(tmp_path):
    """The CRC runs over the whole file in 8 MiB blocks, each chained to the one before: a data file
    past one block with a byte flipped in its first block fails its check (the CRC of a file computed
    here with zlib in one pass is the sidecar's)."""
    uri, m = str(tmp_path / "store"), H.meta(hidden=1024)
    tokens = 600  # 600 tokens x 4 layers x 1024 x 4 bytes: a 9.4 MiB data file, two CRC blocks
    store.append(uri, store.FEATURES, H.table(["big"], m, num_tokens=tokens), meta=m)
    table_dir = store.table_path(uri, store.FEATURES)
    (path,) = [p for p in (table_dir / "data").iterdir()]
    assert path.stat().st_size > 8 << 20
    sidecar = (table_dir / integrity.CRC_DIR / f"{path.name}.crc").read_text()
    assert sidecar == f"{zlib.crc32(path.read_bytes()):08x}"
    with open(path, "r+b") as f:  # one byte in the first MiB (a tensor value's bytes)
        f.seek(1 << 20)
        b = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(StoreError, match="fails its checksum"):
        integrity.check_version(store.dataset(uri, store.FEATURES))
    assert not maintenance.verify(uri, store.FEATURES)["ok"]


def test_value_bytes_do_not_wrap_at_two_gib():
    """A 64K-token row of 4 layers at hidden 8192 in bf16 is 4 GiB of values: the size is exact
    (int64), not wrapped by 32-bit arithmetic into a small or negative number."""
    m = H.meta(dtype="bfloat16", hidden=8192)
    got = S.value_bytes(m, np.array([65536, 1], dtype=np.int32), 4)
    assert got.tolist() == [65536 * 4 * 8192 * 2, 4 * 8192 * 2]


def test_diff_counts_removed_rows_as_a_negative_delta_per_domain(tmp_path):
    """diff from a version to an older one: the rows the older one lacks are removed, and each domain's
    delta is (added) - (removed), recomputed here from the two versions' ids."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m, domain="a"), meta=m)
    v2 = store.append(uri, store.FEATURES, H.table(["b0", "b1", "b2"], m, domain="b"), meta=m)
    v3 = store.append(uri, store.FEATURES, H.table(["c0"], m, domain="c"), meta=m)
    back = versions.diff(uri, store.FEATURES, v3, v2 - 1)
    assert (back["added"], back["removed"]) == (0, 4)
    assert back["per_domain"] == {"b": -3, "c": -1} and back["removed_ids"] == ["b0", "b1", "b2", "c0"]
    forth = versions.diff(uri, store.FEATURES, v2 - 1, v3)
    assert forth["per_domain"] == {"b": 3, "c": 1} and forth["added"] == 4


def test_restore_accepts_a_rollback_of_several_versions(tmp_path):
    """Two newest manifests deleted: the table is rolled back (version 5 was committed, 3 is the newest
    left), and `restore` of version 3 is how the loss is accepted: its new version (4, below the
    recorded 5) becomes the recorded head, so the table opens again, holding version 3's rows."""
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(4):
        _append(uri, [f"s{k}-{i}" for i in range(2)], m)
    latest = store.latest_version(uri, store.FEATURES)
    manifests = sorted((store.table_path(uri, store.FEATURES) / "_versions").glob("*.manifest"),
                       key=lambda p: p.stat().st_mtime_ns)
    for p in manifests[-2:]:
        p.unlink()
    with pytest.raises(StoreError, match=f"rolled back: version {latest} was committed"):
        store.dataset(uri, store.FEATURES)
    new = versions.restore(uri, store.FEATURES, latest - 2)
    assert new == latest - 1 and store.head_version(uri, store.FEATURES) == new  # the record moved back
    assert store.dataset(uri, store.FEATURES).version == new  # no longer refused as rolled back
    assert sorted(store.sample_ids(uri, store.FEATURES)) == [f"s{k}-{i}" for k in range(2) for i in range(2)]
    assert maintenance.verify(uri, store.FEATURES)["ok"]


@pytest.mark.parametrize("raw", ["²", "٣", "2 ", "x"])
def test_a_schema_version_that_is_no_ascii_number_is_a_schema_error(raw):
    """A table another tool wrote with schema_version '²' (a digit to str.isdigit, not to int) was a
    bare ValueError from int(); it is an unreadable schema version, one line."""
    schema = S.FEATURES_SCHEMA.with_metadata({**S.FEATURES_SCHEMA.metadata, b"eaglenest.schema_version": raw.encode()})
    with pytest.raises(SchemaError, match="schema version .*this eaglenest reads"):
        S.validate(schema, S.FEATURES_SCHEMA, what="table 'features'")


def test_versions_lists_each_tag_at_the_version_it_points_to(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    v2 = _append(uri, ["a0"], m, target="A")
    v3 = _append(uri, ["a1"], m, target="A")
    versions.set_tag(uri, store.FEATURES, "first", v2)
    versions.set_tag(uri, store.FEATURES, "latest-good", None)
    versions.set_tag(uri, store.FEATURES, "also.first", "first")
    listed = {v["version"]: v for v in versions.list_versions(uri, store.FEATURES)}
    assert {n: v["tags"] for n, v in listed.items()} == {1: [], v2: ["also.first", "first"], v3: ["latest-good"]}
    assert [listed[n]["rows"] for n in (1, v2, v3)] == [0, 1, 2]
    assert listed[v3]["lineage"]["parent_version"] == v2
