"""Hostile pass over ``gc`` and reader pins (qa11): what ``gc`` promises a live reader, checked end to end."""

from __future__ import annotations

import subprocess
import sys
import time

from eaglenest.featurestore.table import fragments, lease, maintenance, store

import fs_helpers as H  # on sys.path via conftest


def test_a_pinned_version_survives_a_gc_whose_lineage_record_is_slow_to_write(tmp_path, monkeypatch):
    """gc keeps a pinned version "and every newer one". The cut-off it hands Lance is an age measured
    from a clock reading: taken before the lineage record of the versions that may go is written (a
    slow disk, a table of many versions), the pinned version had grown older than that age by the time
    Lance compared, and was removed under the reader."""
    uri, m = str(tmp_path / "store"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"s{i}"], m), meta=m) for i in range(4)]
    real = fragments.keep_lineage

    def slow_keep_lineage(*args, **kwargs):  # the real record, written on a disk that takes its time
        real(*args, **kwargs)
        time.sleep(1.5)

    monkeypatch.setattr(fragments, "keep_lineage", slow_keep_lineage)
    with lease.pin(uri, store.FEATURES, made[1]):
        report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
        assert set(made[1:]) <= set(report["versions_after"]), report  # the pinned one and every newer one
        ids = store.read(uri, store.FEATURES, version=made[1], columns=["sample_id"]).column("sample_id")
    assert ids.to_pylist() == ["s0", "s1"]


def test_a_gc_in_another_thread_sees_a_pin_the_moment_its_file_appears(tmp_path, monkeypatch):
    """A pin file is renamed into the name gc lists once locked. A gc in another thread of the same
    process that lists it at that instant must count it: record locks belong to the process, so that gc
    can lock the file, would take it for a dead reader's, delete it, and (closing its descriptor) drop
    the reader's lock; the version then goes unprotected. The interleaving is forced at the rename."""
    uri, m = str(tmp_path / "store"), H.meta()
    v = store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    seen = []
    real_rename = lease.os.rename

    def rename_then_gc_lists(src, dst):
        real_rename(src, dst)
        if "pins" in str(dst):
            seen.append(lease.pinned_versions(uri, store.FEATURES))  # what gc's listing finds right then

    monkeypatch.setattr(lease.os, "rename", rename_then_gc_lists)
    with lease.pin(uri, store.FEATURES, v):
        monkeypatch.setattr(lease.os, "rename", real_rename)
        assert seen == [{v}]
        assert lease.pinned_versions(uri, store.FEATURES) == {v}  # the pin file is still there
        code = ("import sys\nfrom eaglenest.featurestore.table import lease\n"
                "print(sorted(lease.pinned_versions(sys.argv[1], 'features')))")
        out = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"[{v}]"  # and still locked: another process sees a live reader
