"""The feature store under concurrent writers, maintenance, corruption and hostile table names.

Real Lance tables, real processes (leases are per process, so every concurrent writer here is a
separate interpreter). Issue 10, cases 1, 2, 3, 9 and the store's half of 7 and 11; each test says
which. The real-engine version of cases 1 and 2 (two `featurestore capture` and a `gc` loop at
once) is in test_capture_concurrency.py.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.table import base, fragments, lease, maintenance, store, versions
from eaglenest.featurestore.capture.writer import FeatureWriter

FS_TESTS = Path(__file__).resolve().parent.parent / "featurestore"
sys.path.insert(0, str(FS_TESTS))
import fs_helpers as H  # noqa: E402

PRELUDE = f"import sys; sys.path.insert(0, {str(FS_TESTS)!r}); import fs_helpers as H\n"


def _py(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ids(uri: str, name: str = store.FEATURES) -> list[str]:
    return store.read(uri, name, columns=["sample_id"]).column("sample_id").to_pylist()


def _wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


# A writer that holds the lease, writes fragments and sits in the written-not-committed window
# until told to go on (the file `go` appears), as a capture does between two commits.
HOLDING_WRITER = """
    import os, time
    from pathlib import Path
    from eaglenest.featurestore.table import lease
    from eaglenest.featurestore.capture.writer import FeatureWriter
    uri, go = sys.argv[1], Path(sys.argv[2])
    m = H.meta()
    with lease.hold(uri, "features", purpose="featurestore capture"):
        w = FeatureWriter(uri, "features", m, budget=1)  # a fragment per row
        for r in H.rows([f"held-{i}" for i in range(6)], m):
            w.add(r)
        print("WRITTEN", w.fragments_written, flush=True)
        while not go.exists():
            time.sleep(0.02)
        print("VERSION", w.commit({"who": "holder"}), flush=True)
"""


def test_gc_during_a_write_is_refused_and_loses_nothing(tmp_path, capsys):
    """Case 1: gc --older-than-hours 0 while a writer has fragments written but not committed."""
    uri = str(tmp_path / "store")
    m = H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    go = tmp_path / "go"
    proc = _py(HOLDING_WRITER, uri, str(go))
    assert proc.stdout.readline().split() == ["WRITTEN", "6"]
    data = store.table_path(uri, store.FEATURES) / "data"
    files_before = set(os.listdir(data))
    t0 = time.time()
    lease_wait, lease.MAINTENANCE_WAIT_S = lease.MAINTENANCE_WAIT_S, 0.5
    try:
        code, err = _cli(capsys, "gc", "--older-than-hours", "0", "--grace-hours", "0", f"run.store={uri}",
                         f"run.workdir={tmp_path}")
    finally:
        lease.MAINTENANCE_WAIT_S = lease_wait
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"being written by pid {proc.pid}" in err and "featurestore capture" in err and "since" in err
    assert time.time() - t0 < 10
    assert set(os.listdir(data)) == files_before  # not one uncommitted file deleted
    # Tags touch no data: they are set while the writer writes (a lock of their own, shared with gc).
    tagged = versions.set_tag(uri, store.FEATURES, "during-capture", None)
    go.touch()
    out, errs = proc.communicate(timeout=60)
    assert proc.returncode == 0, errs[-2000:]
    assert sorted(_ids(uri)) == sorted(["a", "b"] + [f"held-{i}" for i in range(6)])
    assert maintenance.verify(uri, store.FEATURES)["ok"]
    assert store.read(uri, store.FEATURES, version="during-capture").num_rows == 2 and tagged == 2
    # Once the writer is gone, gc runs and the table stays whole.
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
    assert g["versions_after"] == [tagged, store.latest_version(uri, store.FEATURES)]  # the tag kept its version
    assert maintenance.verify(uri, store.FEATURES)["ok"] and len(_ids(uri)) == 8


def test_gc_keeps_young_uncommitted_files_of_writers_without_a_lease(tmp_path):
    """Case 1, bare library writers: fragments younger than the grace period survive gc."""
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    frags = fragments.write_fragment(uri, store.FEATURES, H.table(["b", "c"], m), meta=m)
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0)  # default grace: 1 hour
    assert g["uncommitted_files_removed"] == 0
    fragments.commit_fragments(uri, store.FEATURES, frags, meta=m)
    assert sorted(_ids(uri)) == ["a", "b", "c"] and maintenance.verify(uri, store.FEATURES)["ok"]
    # Past the grace period they go, and a late commit of them is a clear error, not a broken table.
    late = fragments.write_fragment(uri, store.FEATURES, H.table(["d"], m), meta=m)
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
    assert g["uncommitted_files_removed"] == 1
    with pytest.raises(StoreError, match="uncommitted data file .* deleted"):
        fragments.commit_fragments(uri, store.FEATURES, late, meta=m)
    assert sorted(_ids(uri)) == ["a", "b", "c"] and maintenance.verify(uri, store.FEATURES)["ok"]


# A capture-shaped writer: lease for the whole run, decide what is missing, write it, commit in
# chunks. Several at once over overlapping ids, plus a maintenance loop.
RESUMING_WRITER = """
    import random, time
    from eaglenest.errors import StoreError
    from eaglenest.featurestore.table import lease, store
    from eaglenest.featurestore.capture.writer import FeatureWriter
    uri, worker = sys.argv[1], int(sys.argv[2])
    rng = random.Random(worker)
    m = H.meta()
    wanted = [f"s{i:03d}" for i in range(0, 60)]
    rng.shuffle(wanted)
    done_runs = 0
    for attempt in range(400):
        try:
            with lease.hold(uri, "features", purpose=f"writer {worker}", wait_s=0.2):
                have = store.sample_ids(uri, "features")
                todo = sorted(set(wanted[: 20 + 10 * done_runs]) - have)
                w = FeatureWriter(uri, "features", m, budget=64)
                for k in range(0, len(todo), 4):
                    for r in H.rows(todo[k:k + 4], m, seed=worker):
                        w.add(r)
                    w.commit({"worker": worker})
                done_runs += 1
            if done_runs == 5:
                print("DONE", flush=True)
                break
        except StoreError as exc:
            assert "being written by" in str(exc), exc
        time.sleep(rng.uniform(0.05, 0.3))  # between runs, as separate CLI runs would be
    """

MAINTENANCE_LOOP = """
    import time
    from pathlib import Path
    from eaglenest.errors import StoreError
    from eaglenest.featurestore.table import lease, maintenance, store, versions
    uri, stop = sys.argv[1], Path(sys.argv[2])
    lease.MAINTENANCE_WAIT_S = 1.0
    counts = {"gc": 0, "compact": 0, "tag": 0, "busy": 0}
    k = 0
    while not stop.exists():
        k += 1
        try:
            if not store.exists(uri, "features"):
                time.sleep(0.05)
                continue
            if k % 3 == 0:
                maintenance.compact(uri, "features"); counts["compact"] += 1
            elif k % 3 == 1:
                maintenance.gc(uri, "features", older_than_hours=0, grace_hours=0); counts["gc"] += 1
            else:
                versions.set_tag(uri, "features", f"t{k % 4}", None); counts["tag"] += 1
        except StoreError as exc:
            assert "being written by" in str(exc), exc
            counts["busy"] += 1
    print("COUNTS", counts, flush=True)
    """


def test_writers_and_maintenance_at_once_store_every_sample_exactly_once(tmp_path):
    """Case 2 (library level): 4 capture-shaped writers over overlapping ids + a gc/compact/tag loop."""
    uri = str(tmp_path / "store")
    stop = tmp_path / "stop"
    loop = _py(MAINTENANCE_LOOP, uri, str(stop))
    writers = [_py(RESUMING_WRITER, uri, str(w)) for w in range(4)]
    outs = [w.communicate(timeout=600) for w in writers]
    stop.touch()
    loop_out, loop_err = loop.communicate(timeout=120)
    for w, (out, err) in zip(writers, outs):
        assert w.returncode == 0 and "DONE" in out, err[-2000:]
    assert loop.returncode == 0, loop_err[-2000:]
    ids = _ids(uri)
    assert collections.Counter(ids).most_common(1)[0][1] == 1  # nothing twice
    assert set(ids) == {f"s{i:03d}" for i in range(60)}  # nothing lost
    report = maintenance.verify(uri, store.FEATURES)
    assert report["ok"], report["problems"]
    counts = eval(loop_out.split("COUNTS", 1)[1])  # the loop really ran between the writers
    assert counts["gc"] >= 1 and counts["compact"] >= 1


def test_commit_refuses_duplicate_sample_ids(tmp_path):
    """Case 2, the last line of defence: a commit that would store a sample twice changes nothing."""
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    v = store.latest_version(uri, store.FEATURES)
    with pytest.raises(StoreError, match=r"1 sample id\(s\) would be stored twice \(e.g. b\)"):
        store.append(uri, store.FEATURES, H.table(["b", "c"], m), meta=m)
    with pytest.raises(StoreError, match=r"would be stored twice \(e.g. x\)"):
        store.append(uri, store.FEATURES, H.table(["x", "x"], m), meta=m)
    assert store.latest_version(uri, store.FEATURES) == v and sorted(_ids(uri)) == ["a", "b"]


def test_verify_finds_duplicates_written_behind_its_back(tmp_path):
    """Case 2: verify checks sample_id uniqueness (duplicates made with Lance directly)."""
    import lance

    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    path = str(store.table_path(uri, store.FEATURES))
    frags = lance.fragment.write_fragments(H.table(["b"], m), path, schema=H.table(["b"], m).schema)
    ds = lance.dataset(path)
    lance.LanceDataset.commit(path, lance.Transaction(read_version=ds.version,
                                                      operation=lance.LanceOperation.Append(frags)))
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"]
    assert any("sample_id: 1 id(s) stored more than once" in p and "b" in p for p in report["problems"])


def test_table_creation_race_is_atomic(tmp_path):
    """Case 11a: many writers creating the empty table at the same moment."""
    uri = str(tmp_path / "store")
    code = """
        import time
        from eaglenest.featurestore.table import store
        uri, w, t0 = sys.argv[1], sys.argv[2], float(sys.argv[3])
        time.sleep(max(0.0, t0 - time.time()))
        m = H.meta()
        store.append(uri, "features", H.table([f"w{w}-{i}" for i in range(3)], m), meta=m)
        """
    t0 = time.time() + 3.0  # all start committing at once, after their imports
    procs = [_py(code, uri, str(w), str(t0)) for w in range(6)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-2000:]
    ds = store.dataset(uri, store.FEATURES)
    assert ds.version == 7 and ds.count_rows() == 18  # one empty create, then six appends
    assert store.dataset(uri, store.FEATURES, 1).count_rows() == 0
    assert not list((Path(uri) / ".eaglenest" / "tmp").glob("*"))  # no leftover of a lost race
    assert maintenance.verify(uri, store.FEATURES)["ok"]


BAD_NAMES = ["../../victim", "../victim", "/tmp/victim", ".hidden", "a/b", "", "x" * 200, "a b", "vict\x00im"]


@pytest.mark.parametrize("bad", BAD_NAMES[:3])
def test_table_name_is_one_identifier_on_every_verb(tmp_path, capsys, bad):
    """Case 3: a table name reaching outside the store is refused by every verb; nothing is touched."""
    victim = tmp_path / "victim.lance"
    uri = tmp_path / "a" / "b" / "store"
    m = H.meta()
    store.append(str(tmp_path / "v"), store.FEATURES, H.table(["a"], m), meta=m)
    (tmp_path / "v" / "features.lance").rename(victim)
    before = sorted(str(p.relative_to(victim)) + str(p.stat().st_mtime_ns) for p in victim.rglob("*"))
    common = [f"run.store={uri}", f"run.workdir={tmp_path}", f"featurestore.table={bad}"]
    verbs = [["versions"], ["tags", "--create", "x"], ["tags", "--delete", "x"], ["restore", "--v", "1"],
             ["compact"], ["gc", "--older-than-hours", "0", "--grace-hours", "0"], ["verify"],
             ["checkout", "--v", "1"], ["diff", "--a", "1", "--b", "1"], ["capture"],
             ["query", "--sql", "SELECT 1", "--version", "1"]]
    for verb in verbs:
        code, err = _cli(capsys, *verb, *common)
        assert code == 2 and "featurestore.table" in err and len(err.strip().splitlines()) == 1, (verb, err)
    after = sorted(str(p.relative_to(victim)) + str(p.stat().st_mtime_ns) for p in victim.rglob("*"))
    assert after == before


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_table_name_is_checked_by_the_library(tmp_path, bad):
    with pytest.raises(StoreError, match="bad table name"):
        store.table_path(str(tmp_path), bad)
    with pytest.raises(StoreError, match="bad table name"):
        maintenance.gc(str(tmp_path), bad, older_than_hours=0)
    with pytest.raises(StoreError, match="bad table name"):
        versions.restore(str(tmp_path), bad, 1)


def test_bad_tag_names_are_refused(tmp_path):
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    for bad in ["../x", "a/b", "", ".x"]:
        with pytest.raises(StoreError, match="bad tag name"):
            versions.set_tag(uri, store.FEATURES, bad, None)


def test_deleted_latest_manifest_is_a_detected_rollback(tmp_path, capsys):
    """Case 9: deleting the newest `_versions` manifest no longer silently drops its rows."""
    uri, m = str(tmp_path), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{k}-{i}" for i in range(4)], m), meta=m)
    latest = store.latest_version(uri, store.FEATURES)
    manifests = sorted((store.table_path(uri, store.FEATURES) / "_versions").glob("*.manifest"),
                       key=lambda p: p.stat().st_mtime_ns)
    manifests[-1].unlink()
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"] and any(f"rolled back: version {latest} was committed" in p for p in report["problems"])
    code, err = _cli(capsys, "verify", f"run.store={uri}", f"run.workdir={tmp_path}")
    assert code == 2 and "rolled back" in err
    for attempt in (lambda: store.read(uri, store.FEATURES),
                    lambda: store.append(uri, store.FEATURES, H.table(["new"], m), meta=m),
                    lambda: maintenance.gc(uri, store.FEATURES, older_than_hours=0),
                    lambda: maintenance.compact(uri, store.FEATURES)):
        with pytest.raises(StoreError, match="rolled back"):
            attempt()
    assert store.read(uri, store.FEATURES, version=latest - 1).num_rows == 8  # older versions still read
    # Accepting the loss is explicit: restore the newest readable version.
    new = versions.restore(uri, store.FEATURES, latest - 1)
    assert maintenance.verify(uri, store.FEATURES)["ok"] and store.dataset(uri, store.FEATURES).version == new
    assert len(_ids(uri)) == 8


def test_a_commit_between_listing_and_check_is_not_a_rollback(tmp_path):
    """A reader listed version N, then a writer committed N + 1 (manifest and head record) before
    the reader's rollback check: that is a newer version, not a lost one (CI saw this race)."""
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    listed = store.latest_version(uri, store.FEATURES)
    store.append(uri, store.FEATURES, H.table(["b"], m), meta=m)
    assert base.head_version(uri, store.FEATURES) == listed + 1
    assert base.rolled_back(uri, store.FEATURES, listed) is None
    # The same gap with the newer manifest really gone is still a rollback.
    newest = max((store.table_path(uri, store.FEATURES) / "_versions").glob("*.manifest"),
                 key=lambda p: p.stat().st_mtime_ns)
    newest.unlink()
    assert f"version {listed + 1} was committed" in base.rolled_back(uri, store.FEATURES, listed)


def test_disk_full_while_writing_commits_nothing_and_resumes(tmp_path):
    """Case 7 (store side): a write failure is one clear StoreError; the table keeps its version."""
    uri = str(tmp_path / "store")
    code = """
        import resource, signal
        from eaglenest.errors import StoreError
        from eaglenest.featurestore.table import store
        from eaglenest.featurestore.capture.writer import FeatureWriter
        uri = sys.argv[1]
        m = H.meta(hidden=256)
        store.append(uri, "features", H.table(["first"], m), meta=m)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))  # a file > 64 KiB: EFBIG
        w = FeatureWriter(uri, "features", m, budget=1 << 30)
        for r in H.rows([f"s{i}" for i in range(40)], m, num_tokens=20):
            w.add(r)
        try:
            w.commit({})
        except StoreError as exc:
            print("ERR", exc)
        """
    p = _py(code, uri)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.startswith("ERR "), err[-2000:]
    line = out.strip()
    assert len(line.splitlines()) == 1 and len(line) < 700
    assert "File too large" in line and "nothing of this commit was committed" in line
    assert _ids(uri) == ["first"] and maintenance.verify(uri, store.FEATURES)["ok"]
    # The re-run (no limit now) stores everything once.
    m = H.meta(hidden=256)
    w = FeatureWriter(uri, store.FEATURES, m, budget=1 << 30)
    for r in H.rows([f"s{i}" for i in range(40)], m, num_tokens=20):
        w.add(r)
    w.commit({})
    assert sorted(_ids(uri)) == sorted(["first"] + [f"s{i}" for i in range(40)])


def test_a_killed_holder_leaves_no_stale_lease(tmp_path):
    """Stale-lease recovery: SIGKILL the holder; the next writer takes the lease at once."""
    uri = str(tmp_path)
    p = _py("""
        import time
        from eaglenest.featurestore.table import lease
        with lease.hold(sys.argv[1], "features", purpose="featurestore capture"):
            print("HELD", flush=True)
            time.sleep(600)
        """, uri)
    assert p.stdout.readline().strip() == "HELD"
    info = lease.holder(uri, store.FEATURES)
    assert info["pid"] == p.pid and info["purpose"] == "featurestore capture"
    with pytest.raises(StoreError, match=f"being written by pid {p.pid} on host .* since .*featurestore capture"):
        with lease.hold(uri, store.FEATURES, purpose="test", wait_s=0.2):
            pass
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    t0 = time.time()
    with lease.hold(uri, store.FEATURES, purpose="test", wait_s=0):
        assert lease.held_here(uri, store.FEATURES)
    assert time.time() - t0 < 1.0 and lease.holder(uri, store.FEATURES) is None


def test_a_missing_data_file_is_one_line_not_a_traceback(tmp_path):
    """Case 1's aftermath: reads of a table with a lost data file say so and point at verify."""
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    store.append(uri, store.FEATURES, H.table(["b"], m), meta=m)
    frag = store.dataset(uri, store.FEATURES).get_fragments()[1]
    (store.table_path(uri, store.FEATURES) / "data" / frag.data_files()[0].path).unlink()
    with pytest.raises(StoreError, match="cannot read it .*featurestore verify") as err:
        store.sample_ids(uri, store.FEATURES)
    assert len(str(err.value)) < 600 and "\n" not in str(err.value)
    report = maintenance.verify(uri, store.FEATURES)
    assert any(f"fragment {frag.fragment_id}: data file" in p and "missing" in p for p in report["problems"])


def test_gc_keeps_the_version_a_training_run_reads(tmp_path):
    """Maintenance during training: the trainer pins its version; compact + gc cannot pull it away."""
    uri, m = str(tmp_path), H.meta()
    store.append(uri, store.FEATURES, H.table([f"a{i}" for i in range(4)], m), meta=m)
    pinned = store.latest_version(uri, store.FEATURES)
    go = tmp_path / "go"
    reader = _py("""
        import time
        from pathlib import Path
        from eaglenest.train.data import FeatureShards
        uri, version, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
        data = FeatureShards(uri, version=version, split="train", pack_tokens=64, batch_rows=2, seed=0)
        print("READY", flush=True)
        while not go.exists():
            time.sleep(0.02)
        n = sum(int(b.loss_mask.sum()) for rows in data.plan(0) for b in [data.read(rows)])
        data.close()
        print("READ", n, flush=True)
        """, uri, str(pinned), str(go))
    assert reader.stdout.readline().strip() == "READY"
    store.append(uri, store.FEATURES, H.table([f"b{i}" for i in range(4)], m), meta=m)
    maintenance.compact(uri, store.FEATURES)  # rewrites the pinned version's rows into a new file
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
    assert pinned in g["versions_after"] and g["pinned_versions_kept"] == [pinned]
    go.touch()
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0 and out.split()[-2] == "READ", err[-2000:]
    assert int(out.split()[-1]) == sum(r["num_loss_tokens"] for r in H.rows([f"a{i}" for i in range(4)], m))
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)  # the run is over
    assert pinned not in g["versions_after"]
    assert maintenance.verify(uri, store.FEATURES)["ok"]
