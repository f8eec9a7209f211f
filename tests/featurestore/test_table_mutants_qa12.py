"""Mutation audit of table maintenance (qa12): what ``verify`` finds when a fragment is scanned in several
batches, ``checkout`` of an older version, a killed holder's longer lease record, and the edges of version
numbers; each checked from first principles (a count made by hand, a round trip, an independent reader)."""

from __future__ import annotations

import signal
import threading
import subprocess
import sys

import lance
import numpy as np
import pyarrow as pa
import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import lease, maintenance, names, store, versions

import fs_helpers as H  # on sys.path via conftest


def test_verify_finds_every_problem_of_a_fragment_scanned_batch_by_batch(tmp_path, monkeypatch):
    """``verify`` decodes a fragment batch by batch (bounded memory). A row whose sizes disagree in the
    first batch, and NaNs in two rows of two other batches, are all reported: the problem is not replaced
    by a later clean batch, and the NaN count is the sum over batches (2, counted here by hand)."""
    uri, m = str(tmp_path / "s"), H.meta()
    store.append(uri, store.FEATURES, H.table(["ok0"], m), meta=m)
    rows = H.rows(["bad", "n1", "ok1", "n2"], m)
    rows[0]["loss_mask"] = rows[0]["loss_mask"][:-1]  # one value short of num_tokens: written past eaglenest's checks
    for k in (1, 3):
        aux = np.zeros((rows[k]["num_tokens"], len(m.layer_ids), m.hidden_size), "float32")
        aux[0, 0, k] = np.nan
        rows[k]["aux_hidden"] = S.encode_tensor(aux, m.dtype)
    table_uri = str(store.table_path(uri, store.FEATURES))
    lance.write_dataset(pa.Table.from_pylist(rows, schema=store.dataset(uri, store.FEATURES).schema), table_uri,
                        mode="append")
    monkeypatch.setattr(maintenance, "SCAN_BYTES", 1)  # one row per batch
    report = maintenance.verify(uri, store.FEATURES)
    assert any("row 'bad': loss_mask holds" in p for p in report["problems"]), report["problems"]
    nan = [p for p in report["problems"] if "NaN/inf in aux_hidden" in p]
    assert len(nan) == 1 and "2 row(s)" in nan[0] and "n1" in nan[0] and "n2" in nan[0], report["problems"]
    assert report["rows"] == 5


def test_checkout_of_an_older_version_counts_that_version_s_rows(tmp_path):
    """``featurestore checkout --v N`` counts rows per domain/split at version N, as a plain read of that
    version does (not the latest's)."""
    uri, m = str(tmp_path / "s"), H.meta()
    old = store.append(uri, store.FEATURES, H.table(["a0", "a1"], m, domain="code"), meta=m)
    store.append(uri, store.FEATURES, H.table(["b0", "b1", "b2"], m, domain="chat"), meta=m)
    report = versions.summary(uri, store.FEATURES, old)
    t = store.read(uri, store.FEATURES, version=old, columns=["domain"])
    assert report["version"] == old and report["rows"] == t.num_rows == 2
    assert report["counts"] == {"code/train": 2}


#: Holds the table's lease with a long purpose, then SIGKILLs itself (the lease record is never cleared).
KILLED_HOLDER = ("import os, signal, sys\n"
                 "from eaglenest.featurestore.table import lease\n"
                 "with lease.hold(sys.argv[1], 'features', purpose='x' * 250):\n"
                 "    os.kill(os.getpid(), signal.SIGKILL)\n")
HOLDER = ("import sys\n"
          "from eaglenest.featurestore.table import lease\n"
          "with lease.hold(sys.argv[1], 'features', purpose='short'):\n"
          "    print('held', flush=True)\n"
          "    sys.stdin.read()\n")


def test_the_next_holder_after_a_killed_one_is_named_in_full(tmp_path):
    """A holder killed while holding leaves its (long) record in the lease file; the next holder's shorter
    record must replace it, not be written over its start (a garbled record names no holder)."""
    uri = str(tmp_path / "s")
    proc = subprocess.run([sys.executable, "-c", KILLED_HOLDER, uri], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, uri], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        info = lease.holder(uri, store.FEATURES)
        assert info and info["purpose"] == "short" and info["pid"] == holder.pid, info
    finally:
        holder.communicate("", timeout=60)


def test_the_largest_version_number_is_a_version_number():
    """``--version 9223372036854775807`` (Lance's largest) is a number, one more is refused."""
    assert names.version_arg(str(names.MAX_VERSION)) == names.MAX_VERSION == 2**63 - 1
    with pytest.raises(Exception, match="no such version"):
        names.version_arg(str(names.MAX_VERSION + 1))


def test_version_zero_is_named_missing_not_garbage_collected(tmp_path):
    """Lance numbers versions from 1: after a gc removed the oldest ones, version 0 was never there, and its
    error must not send the user looking for a gc that removed it."""
    uri, m = str(tmp_path / "s"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"a{i}"], m), meta=m) for i in range(3)]
    maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    with pytest.raises(StoreError) as gone:
        store.dataset(uri, store.FEATURES, made[0])
    assert "garbage-collected" in str(gone.value)
    with pytest.raises(StoreError) as zero:
        versions.restore(uri, store.FEATURES, 0)
    assert "has no version 0" in str(zero.value) and "garbage-collected" not in str(zero.value)


def test_gc_removes_exactly_the_checksums_of_the_data_files_it_removed(tmp_path):
    """After a compact and a gc, the CRC sidecars (and stamps) left are exactly those of the data files the
    remaining versions reference: every live file is still checked by ``verify``, none removed is left."""
    uri, m = str(tmp_path / "s"), H.meta()
    for i in range(3):
        store.append(uri, store.FEATURES, H.table([f"a{i}"], m), meta=m)
    maintenance.compact(uri, store.FEATURES)
    crc_dir = store.table_path(uri, store.FEATURES) / maintenance.CRC_DIR
    before = {p.name for p in crc_dir.iterdir()}
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    live = {df.path for f in store.dataset(uri, store.FEATURES).get_fragments() for df in f.data_files()}
    assert len(live) == 1 and report["versions_after"] == [store.latest_version(uri, store.FEATURES)]
    assert {p.name for p in crc_dir.iterdir()} == {f"{n}.{ext}" for n in live for ext in ("crc", "stamp")}
    assert report["checksums_removed"] == len(before) - 2 == 6
    assert maintenance.verify(uri, store.FEATURES)["unchecked_files"] == []


def test_verify_finds_a_sample_id_stored_twice(tmp_path):
    """One id stored a second time (appended past eaglenest's duplicate check, by another tool): ``verify``
    names it, with one extra row, as a count made by hand says."""
    uri, m = str(tmp_path / "s"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    lance.write_dataset(H.table(["a1", "a2"], m), str(store.table_path(uri, store.FEATURES)), mode="append")
    report = maintenance.verify(uri, store.FEATURES)
    assert "sample_id: 1 id(s) stored more than once, 1 extra row(s) (e.g. a1)" in report["problems"], report


#: A reader SIGKILLed while it holds its pin (the pin file stays, its lock goes with the process).
KILLED_READER = ("import os, signal, sys\n"
                 "from eaglenest.featurestore.table import lease\n"
                 "with lease.pin(sys.argv[1], 'features', int(sys.argv[2])):\n"
                 "    os.kill(os.getpid(), signal.SIGKILL)\n")


def test_a_killed_readers_pin_is_not_counted_and_its_file_is_removed(tmp_path):
    """A reader killed while reading leaves its pin file unlocked: listing the pins neither counts it (gc
    may remove that version) nor leaves it behind, and gc then removes the version."""
    uri, m = str(tmp_path / "s"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"a{i}"], m), meta=m) for i in range(2)]
    proc = subprocess.run([sys.executable, "-c", KILLED_READER, uri, str(made[0])], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    pins = lease.store_dir(uri) / ".eaglenest" / "pins" / store.FEATURES
    assert [p.suffix for p in pins.iterdir()] == [".json"]
    assert lease.pinned_versions(uri, store.FEATURES) == set() and list(pins.iterdir()) == []
    assert maintenance.gc(uri, store.FEATURES, older_than_hours=0)["versions_after"] == [made[1]]


def test_another_thread_of_the_process_waits_for_a_held_lease(tmp_path):
    """Record locks belong to the process, so a second thread would "take" a lease the first holds at once;
    the lease makes it wait, and say who holds it when its wait runs out; the holding thread re-enters."""
    uri = str(tmp_path / "s")
    held, release, seen = threading.Event(), threading.Event(), []

    def holder():
        with lease.hold(uri, store.FEATURES, purpose="first"):
            with lease.hold(uri, store.FEATURES, purpose="first, again"):  # the holding thread re-enters
                held.set()
                release.wait(60)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(60)
        with pytest.raises(StoreError, match="another thread of this process"):
            with lease.hold(uri, store.FEATURES, purpose="second", wait_s=0.3):
                seen.append("entered")
    finally:
        release.set()
        t.join(60)
    assert seen == []
    with lease.hold(uri, store.FEATURES, purpose="second", wait_s=5):  # free once the first thread left
        seen.append("entered")
    assert seen == ["entered"]


def test_an_append_holding_one_id_twice_is_refused_and_commits_nothing(tmp_path):
    """The duplicate check covers ids repeated inside the batch being appended, not only ids already stored:
    ``a1`` twice in one append is refused in one line naming it, and the table is as it was."""
    uri, m = str(tmp_path / "s"), H.meta()
    v = store.append(uri, store.FEATURES, H.table(["a0"], m), meta=m)
    with pytest.raises(StoreError, match="a1"):
        store.append(uri, store.FEATURES, H.table(["a1", "a2", "a1"], m), meta=m)
    assert store.latest_version(uri, store.FEATURES) == v and store.sample_ids(uri, store.FEATURES) == {"a0"}
