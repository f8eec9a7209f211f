"""Mutation audit of table maintenance and versions (qa11): gc's choice of what to keep, tags, restore,
leases and names, each checked from first principles (an invariant, a round trip) where no earlier
test pinned the behaviour."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.table import lease, maintenance, names, store, versions

import fs_helpers as H  # on sys.path via conftest


def _ids(uri, version):
    return store.read(uri, store.FEATURES, version=version, columns=["sample_id"]).column("sample_id").to_pylist()


def test_gc_keeps_every_pinned_version_not_only_the_newest_pin(tmp_path):
    """Two readers pin two versions: gc keeps the older pin's version (and every newer one), so both
    still read their rows; a cut-off taken from the newest pin would remove the older one."""
    uri, m = str(tmp_path / "store"), H.meta()
    made = []
    for i in range(4):
        if i == 2:  # the two pinned versions further apart than gc's one-second margin
            time.sleep(1.2)
        made.append(store.append(uri, store.FEATURES, H.table([f"s{i}"], m), meta=m))
    with lease.pin(uri, store.FEATURES, made[1]), lease.pin(uri, store.FEATURES, made[2]):
        assert lease.pinned_versions(uri, store.FEATURES) == {made[1], made[2]}
        report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
        assert set(made[1:]) <= set(report["versions_after"]), report
        assert report["pinned_versions_kept"] == sorted({made[1], made[2]})
        assert _ids(uri, made[1]) == ["s0", "s1"] and _ids(uri, made[2]) == ["s0", "s1", "s2"]


def _age(paths, hours: float) -> None:
    then = time.time() - hours * 3600
    for p in paths:
        os.utime(p, (then, then))


def test_gc_keeps_old_data_files_a_tagged_version_still_reads_after_a_compact(tmp_path):
    """After a compact the latest version references only the new file; the tagged old version still
    references the old ones. gc counts every remaining version's files as live, however old they are
    (past the grace period, a file no version references is swept as uncommitted)."""
    uri, m = str(tmp_path / "store"), H.meta()
    for i in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{i}"], m, seed=i), meta=m)
    store.tag(uri, store.FEATURES, "good", store.latest_version(uri, store.FEATURES))
    want = store.read(uri, store.FEATURES, version="good")
    maintenance.compact(uri, store.FEATURES)
    data = store.table_path(uri, store.FEATURES) / "data"
    _age(data.iterdir(), 5)  # every data file far past the grace period
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert report["uncommitted_files_removed"] == 0, report
    assert store.read(uri, store.FEATURES, version="good").equals(want)
    assert maintenance.verify(uri, store.FEATURES, version="good")["ok"]


def test_a_compacted_file_is_checksummed_so_a_flipped_byte_in_it_is_found(tmp_path):
    """compact writes a new data file holding every row; it gets its CRC sidecar at once, so verify
    checks it (no file left unchecked) and names a byte flipped in it afterwards."""
    uri, m = str(tmp_path / "store"), H.meta()
    for i in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{i}"], m, seed=i), meta=m)
    maintenance.compact(uri, store.FEATURES)
    report = maintenance.verify(uri, store.FEATURES)
    assert report["ok"] and report["fragments"] == 1 and report["unchecked_files"] == [], report
    (frag,) = store.dataset(uri, store.FEATURES).get_fragments()
    (df,) = frag.data_files()
    path = store.table_path(uri, store.FEATURES) / "data" / df.path
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    path.write_bytes(bytes(raw))
    problems = maintenance.verify(uri, store.FEATURES)["problems"]
    assert any(df.path in p and "checksum" in p for p in problems), problems


def _holder(uri: str, kind: str, seconds: float) -> subprocess.Popen:
    """Another process holding table features' ``kind`` lock for ``seconds`` (then exiting), once it says HELD."""
    code = ("import sys, time\nfrom eaglenest.featurestore.table import lease\n"
            f"with lease.hold(sys.argv[1], 'features', purpose='featurestore gc', kind={kind!r}):\n"
            f"    print('HELD', flush=True)\n    time.sleep({seconds})\n")
    p = subprocess.Popen([sys.executable, "-c", code, uri], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "HELD"
    return p


def test_a_tag_change_waits_for_gc_s_tags_lock_and_then_names_it(tmp_path, monkeypatch):
    """gc holds the tags lock while it decides what to remove: a tag change in another process is
    refused naming that gc (not written meanwhile, where it could point at a version gc is removing)."""
    uri, m = str(tmp_path / "store"), H.meta()
    v = store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    monkeypatch.setattr(lease, "MAINTENANCE_WAIT_S", 0.3)
    p = _holder(uri, "tags", 60)
    try:
        with pytest.raises(StoreError, match=f"pid {p.pid} .*featurestore gc"):
            versions.set_tag(uri, store.FEATURES, "good", v)
    finally:
        p.kill()
        p.wait(30)
    assert "good" not in store.tag_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES)
    assert versions.set_tag(uri, store.FEATURES, "good", v) == v  # free again: set at once


def test_a_maintenance_verb_waits_out_a_short_writer_instead_of_failing(tmp_path):
    """compact waits up to ``MAINTENANCE_WAIT_S`` (5 s) for a busy table: a writer that finishes within
    a second delays it, and it then compacts."""
    uri, m = str(tmp_path / "store"), H.meta()
    for i in range(2):
        store.append(uri, store.FEATURES, H.table([f"s{i}"], m), meta=m)
    p = _holder(uri, "lease", 1.0)
    try:
        t0 = time.monotonic()
        report = maintenance.compact(uri, store.FEATURES)
    finally:
        p.wait(30)
    assert report["fragments_after"] == 1 and time.monotonic() - t0 < lease.MAINTENANCE_WAIT_S


def test_versions_and_diff_report_rows_and_ends_from_the_table_itself(tmp_path):
    """``versions`` gives each version's row count and ``diff`` the versions it compared, each checked
    against a read of that version."""
    uri, m = str(tmp_path / "store"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"s{i}a", f"s{i}b", f"s{i}c"][:i + 1], m), meta=m)
            for i in range(3)]
    listed = {v["version"]: v["rows"] for v in versions.list_versions(uri, store.FEATURES)}
    assert {v: listed[v] for v in made} == {v: len(_ids(uri, v)) for v in made} == dict(zip(made, [1, 3, 6]))
    d = versions.diff(uri, store.FEATURES, made[0], made[2])
    assert (d["from"], d["to"], d["added"], d["removed"]) == (made[0], made[2], 5, 0)
    back = versions.diff(uri, store.FEATURES, made[2], made[0])
    assert (back["from"], back["to"], back["added"], back["removed"]) == (made[2], made[0], 0, 5)


@pytest.mark.parametrize("length,ok", [(128, True), (129, False)])
def test_a_table_name_is_at_most_128_characters(length, ok):
    """The documented rule ``[A-Za-z0-9][A-Za-z0-9_-]{0,127}``: 128 characters pass, 129 are refused."""
    name = "t" * length
    if ok:
        assert names.check_name(name) == name
    else:
        with pytest.raises(StoreError, match="bad table name"):
            names.check_name(name)


def test_gc_sweeps_only_its_own_table_s_create_temporaries_and_leaves_a_stray_folder(tmp_path):
    """A killed create leaves ``.eaglenest/tmp/<table>.<hex>.lance``: gc of one table sweeps its own
    old one, not another table's (that table's gc does), and a folder someone put in ``data/`` is no
    uncommitted data file: left where it is, the gc completing."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    tmp = tmp_path / "store" / ".eaglenest" / "tmp"
    mine, other = tmp / "features.0a1b.lance", tmp / "features2.0a1b.lance"
    folder = store.table_path(uri, store.FEATURES) / "data" / "notes"
    for p in (mine, other, folder):
        p.mkdir(parents=True)
        (p / "f").write_text("x")
    _age([mine, other, folder, folder / "f"], 5)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    assert report["temporary_files_removed"] == 1 and not mine.exists() and other.exists()
    assert report["uncommitted_files_removed"] == 0 and (folder / "f").exists()


def test_verify_counts_a_fragment_s_rows_net_of_rows_another_tool_deleted(tmp_path):
    """A row deleted with Lance itself (another tool) stays in the data file, marked in a deletion file:
    verify reads the rest, compares it with the manifest's rows net of deletions, and finds no problem."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["s0", "s1", "s2"], m), meta=m)
    store.dataset(uri, store.FEATURES).delete("sample_id = 's1'")
    store.record_head(uri, store.FEATURES, store.dataset(uri, store.FEATURES, allow_rolled_back=True).version)
    report = maintenance.verify(uri, store.FEATURES)
    assert report["ok"] and report["rows"] == 2, report
    assert _ids(uri, None) == ["s0", "s2"]


def test_a_commit_through_another_spelling_of_the_store_keeps_the_held_lease(tmp_path):
    """A capture holds the lease through one spelling of the store (a symlink) and commits through
    another (the real path): one lease, re-entered. Opened and closed a second time under the other
    spelling, the lock file's close would drop the capture's lock, and another process could write."""
    real = tmp_path / "store"
    uri, m = str(real), H.meta()
    store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    code = ("import sys\nfrom eaglenest.featurestore.table import lease\n"
            "print((lease.holder(sys.argv[1], 'features') or {}).get('pid'))")
    with lease.hold(str(link), store.FEATURES, purpose="featurestore capture"):
        store.append(uri, store.FEATURES, H.table(["s1"], m), meta=m)
        out = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(os.getpid())  # still held by this process, seen from another
    assert _ids(uri, None) == ["s0", "s1"]


@pytest.mark.parametrize("text", ["-1", "+3", " -2 "])
def test_a_signed_version_is_refused_as_no_version_number_not_looked_up_as_a_tag(text):
    """``--v -1`` (Python's "the last one") is no version and no tag (tags start with a letter): one line
    saying how versions are numbered, before the table is opened."""
    with pytest.raises(ConfigError, match="not a version number"):
        names.version_arg(text, "--v")
    assert names.version_arg("3") == 3 and names.version_arg("good") == "good"
