"""The table layer against records written by other tools or damaged (session 48)."""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from eaglenest.errors import ConfigError, SchemaError, StoreError
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import base, fragments, lease, maintenance, store, versions

import fs_helpers as H  # on sys.path via conftest


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", "\"text\""])
def test_versions_lists_a_version_whose_lineage_is_not_an_object(tmp_path, monkeypatch, caplog, raw):
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m, lineage={"manifest_hash": "m0"})
    real = json.dumps  # the json module is shared: garble only the lineage record
    monkeypatch.setattr(fragments.json, "dumps",
                        lambda obj, **k: raw if isinstance(obj, dict) and "parent_version" in obj else real(obj, **k))
    store.append(uri, store.FEATURES, H.table(["b0", "b1"], m), meta=m, lineage={"manifest_hash": "m1"})
    monkeypatch.undo()
    with caplog.at_level("WARNING"):
        listed = versions.list_versions(uri, store.FEATURES)
    assert [(v["lineage"] or {}).get("manifest_hash") for v in listed][-2:] == ["m0", None]
    assert listed[-1]["lineage"] == {"unreadable": raw}
    assert "not a JSON object" in caplog.text
    json.dumps(listed)  # still printable as JSON by `featurestore versions --json`


def test_a_lease_record_that_is_not_an_object_names_no_holder(tmp_path):
    """A holder record overwritten with other JSON (a list) is read as 'no holder recorded', not a crash."""
    uri = str(tmp_path)
    code = textwrap.dedent("""
        import sys, time
        from eaglenest.featurestore.table import lease
        with lease.hold(sys.argv[1], "features", purpose="test holder"):
            f = open(lease.lease_path(sys.argv[1], "features"), "r+")  # kept open: a close drops the lock
            f.truncate(0)
            f.write("[1, 2]")
            f.flush()
            print("HELD", flush=True)
            time.sleep(600)
        """)
    p = subprocess.Popen([sys.executable, "-c", code, uri], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "HELD"
        assert lease.holder(uri, store.FEATURES) == {}
        with pytest.raises(StoreError, match=r"another process \(no holder recorded\)"):
            with lease.hold(uri, store.FEATURES, purpose="test", wait_s=0.2):
                pass
    finally:
        p.kill()
        p.wait(30)


def test_gc_sweeps_the_temporary_files_a_killed_writer_left(tmp_path):
    """SIGKILL mid checksum write / mid table create leaves temporaries; gc removes the old ones only."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    crc_dir = store.table_path(uri, store.FEATURES) / maintenance.CRC_DIR
    live_crc = sorted(crc_dir.glob("*.crc"))[0]
    old_crc_tmp = live_crc.with_name(live_crc.name + ".tmp99999")  # its data file is live: not 'stale'
    old_crc_tmp.write_text("123")
    fresh_crc_tmp = live_crc.with_name(live_crc.name + ".tmp99998")
    fresh_crc_tmp.write_text("456")
    old_create = tmp_path / "store" / ".eaglenest" / "tmp" / f"{store.FEATURES}.deadbeef.lance"
    (old_create / "data").mkdir(parents=True)
    (old_create / "data" / "x.lance").write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    for p in (old_crc_tmp, old_create):
        os.utime(p, (two_hours_ago, two_hours_ago))
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert report["temporary_files_removed"] == 2
    assert not old_crc_tmp.exists() and not old_create.exists()
    assert fresh_crc_tmp.exists() and live_crc.exists()  # a live writer's temporaries are younger than grace
    assert maintenance.verify(uri, store.FEATURES)["ok"]


@pytest.mark.parametrize("reader", ["read", "iter_batches"])
def test_reading_a_column_the_table_lacks_names_it(tmp_path, reader):
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0"], m), meta=m)
    with pytest.raises(SchemaError, match=r"table 'features' version \d+ has no column 'nosuch' \(it has .*sample_id"):
        list(getattr(base, reader)(uri, store.FEATURES, columns=["sample_id", "nosuch"]))


def test_store_loss_token_counts_name_an_id_outside_the_vocab(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    t = H.table(["a0", "a1"], m)
    store.append(uri, store.FEATURES, t, meta=m)
    top = max(max(ids) for ids in t.column("input_ids").to_pylist())
    with pytest.raises(ConfigError, match=rf"token id {top} is outside the target vocab \[0, {top}\)"):
        query.loss_token_counts(uri, store.FEATURES, version=None, split="train", vocab_size=top)
