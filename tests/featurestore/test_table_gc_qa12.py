"""Hostile pass over ``gc`` (qa12): what it may delete in a table's folder (Lance's own rule: only
``data/*.lance`` files no version references, past the grace period), a pin's temporary left by a
killed reader, and a pin taken while gc is deciding what to remove."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from eaglenest.featurestore.table import fragments, lease, maintenance, store

import fs_helpers as H  # on sys.path via conftest


def _age(path, hours: float) -> None:
    old = time.time() - hours * 3600
    os.utime(path, (old, old))


def test_gc_sweeps_only_lance_data_files_from_the_data_folder(tmp_path):
    """A user's notes, an editor's swap file, a half-copied parquet in ``data/``: Lance's own cleanup deletes
    only unreferenced ``*.lance`` files there, and gc's sweep of uncommitted files must not do more. A
    stray, old, unreferenced Lance data file (a killed writer's) is still swept."""
    uri, m = str(tmp_path / "my store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    data = store.table_path(uri, store.FEATURES) / "data"
    (committed,) = list(data.iterdir())
    others = {"NOTES.txt": b"my notes", ".notes.txt.swp": b"vim", "part-0.parquet": b"PAR1",
              "backup.lance.bak": b"x", "lance": b"y"}
    for file_name, content in others.items():
        (data / file_name).write_bytes(content)
    orphan = data / ("0" * 24 + "f" * 26 + ".lance")  # named like Lance's own data files, no version has it
    orphan.write_bytes(committed.read_bytes())
    for p in data.iterdir():
        _age(p, 2)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert report["uncommitted_files_removed"] == 1 and not orphan.exists(), report
    assert {p.name: p.read_bytes() for p in data.iterdir() if p != committed} == others
    assert store.sample_ids(uri, store.FEATURES) == {"a0", "a1"}


#: A reader SIGKILLed while making its pin: the temporary is written and locked, not yet renamed.
KILLED_PIN = ("import os, signal, sys\n"
              "from eaglenest.featurestore.table import lease\n"
              "os.rename = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
              "with lease.pin(sys.argv[1], 'features', int(sys.argv[2])):\n"
              "    pass\n")


def test_a_killed_readers_pin_temporary_is_swept_once_old_and_never_counted_as_a_pin(tmp_path):
    """A pin is written as ``<pid>-<id>.tmp`` and renamed to ``.json``: a reader killed between the two
    left the temporary in the pins folder for good (nothing listed or removed ``*.tmp``). Once its lock
    is gone and it is older than a minute, listing the pins removes it, as it removes a dead reader's pin;
    a young one may be a live reader's and stays. It is never taken for a pin."""
    uri, m = str(tmp_path / "store"), H.meta()
    v = store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    proc = subprocess.run([sys.executable, "-c", KILLED_PIN, uri, str(v)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    pins = lease.store_dir(uri) / ".eaglenest" / "pins" / store.FEATURES
    (left,) = list(pins.iterdir())
    assert left.suffix == ".tmp" and f'"version": {v}' in left.read_text()
    assert lease.pinned_versions(uri, store.FEATURES) == set() and left.exists()  # young: not yet swept
    _age(left, 1)
    assert lease.pinned_versions(uri, store.FEATURES) == set() and not left.exists()
    assert store.sample_ids(uri, store.FEATURES) == {"s0"}


def test_a_live_readers_pin_temporary_is_never_swept(tmp_path):
    """A reader's temporary that is still locked (the reader is alive, waiting to rename it) stays, however
    old its time stamp: listing the pins from another process must not remove it under the reader."""
    uri, m = str(tmp_path / "store"), H.meta()
    v = store.append(uri, store.FEATURES, H.table(["s0"], m), meta=m)
    pins = lease.store_dir(uri) / ".eaglenest" / "pins" / store.FEATURES
    pins.mkdir(parents=True)
    live = pins / "1-abcdef12.tmp"
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(live)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        _age(live, 2)
        assert lease.pinned_versions(uri, store.FEATURES) == set() and live.exists()
    finally:
        proc.communicate("", timeout=60)
    # the control: once its reader is gone (the lock with it), the same old temporary is swept, so it was the
    # lock that kept it above, not a name or an age the sweep does not look at
    assert list(pins.iterdir()) == [live]
    assert lease.pinned_versions(uri, store.FEATURES) == set() and not live.exists()
    assert store.sample_ids(uri, store.FEATURES) == {"s0"} and v >= 1


#: Pins ``version`` as a training run does (open, pin, open again by number), prints how that went, and
#: keeps the pin until its stdin closes. Its pin waits at most 0.5 s for a gc deciding what to remove.
PINNER = ("import sys\n"
          "from eaglenest.errors import StoreError\n"
          "from eaglenest.featurestore.table import lease, store\n"
          "lease.PIN_WAIT_S = 0.5\n"
          "uri, v = sys.argv[1], int(sys.argv[2])\n"
          "try:\n"
          "    with lease.pin(uri, 'features', v):\n"
          "        store.dataset(uri, 'features', v)\n"
          "        print('pinned', flush=True)\n"
          "        sys.stdin.read()\n"
          "except StoreError as exc:\n"
          "    print('refused:', exc, flush=True)\n")


def test_a_pin_taken_while_gc_decides_is_kept_or_refused(tmp_path, monkeypatch):
    """gc lists the pins, then removes old versions. A reader that pins an old version between the two
    (another process, forced into that gap by a hook on the age gc hands Lance) must either keep its version
    (gc sees the pin) or be told, in one line, that gc is running: pinned and then deleted under it, the
    reader fails half-way with missing files."""
    uri, m = str(tmp_path / "store"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"s{i}"], m), meta=m) for i in range(3)]
    real = maintenance._max_age
    pinner, calls = [], []

    def pinned_meanwhile(*args, **kwargs):  # the second call is just before Lance removes: a reader pins then
        calls.append(1)
        if len(calls) == 2:
            proc = subprocess.Popen([sys.executable, "-c", PINNER, uri, str(made[0])], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
            pinner.append((proc, proc.stdout.readline().strip()))  # waits until the pin is taken or refused
        return real(*args, **kwargs)

    monkeypatch.setattr(maintenance, "_max_age", pinned_meanwhile)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    assert len(calls) == 2, calls  # the age is read for the lineage record, then for Lance
    (proc, said), = pinner
    try:
        assert said == "pinned" or said.startswith("refused:"), said
        if said == "pinned":
            assert made[0] in report["versions_after"], report
            ids = store.read(uri, store.FEATURES, version=made[0], columns=["sample_id"]).column("sample_id")
            assert ids.to_pylist() == ["s0"]
        else:
            assert "featurestore gc" in said and made[0] not in report["versions_after"], (said, report)
    finally:
        proc.communicate("", timeout=60)
    assert proc.returncode == 0


def test_a_pin_taken_while_gc_writes_the_lineage_record_is_kept(tmp_path, monkeypatch):
    """gc lists the pins, writes the lineage of the versions that may go (a slow write on a big table), then
    removes. A reader that pins an old version during that write (another process, started from a hook on
    the write, waited for until pinned) keeps it: gc lists the pins again before Lance removes."""
    uri, m = str(tmp_path / "store"), H.meta()
    made = [store.append(uri, store.FEATURES, H.table([f"s{i}"], m), meta=m) for i in range(3)]
    real = fragments.keep_lineage
    pinner = []

    def pinned_meanwhile(*args, **kwargs):
        proc = subprocess.Popen([sys.executable, "-c", PINNER, uri, str(made[0])], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        pinner.append((proc, proc.stdout.readline().strip()))
        return real(*args, **kwargs)

    monkeypatch.setattr(fragments, "keep_lineage", pinned_meanwhile)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    (proc, said), = pinner
    try:
        assert said == "pinned", said
        assert made[0] in report["pinned_versions_kept"] and set(made) <= set(report["versions_after"]), report
        ids = store.read(uri, store.FEATURES, version=made[0], columns=["sample_id"]).column("sample_id")
        assert ids.to_pylist() == ["s0"]
    finally:
        proc.communicate("", timeout=60)
    assert proc.returncode == 0
