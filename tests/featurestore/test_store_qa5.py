"""The store's verbs, fifth pass: a version ``gc`` removed is named as garbage-collected (with the
oldest version kept), not "no version N"; ``gc`` on object storage says reader pins do not exist
there; a store whose pins cannot be written warns once per table, not on every read (and not at all
on a read-only file system, where no gc can run)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pyarrow as pa
import pytest

import fs_helpers as H
from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import lease, maintenance, store, versions

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


@pytest.fixture
def collected(tmp_path):
    """Versions 1 (empty) to 5 of features, version 2 tagged, then ``gc`` of everything older: 2 and 5 stay."""
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(4):
        store.append(uri, store.FEATURES, H.table([f"s{k}a", f"s{k}b"], m), meta=m)
    versions.set_tag(uri, store.FEATURES, "keep", 2)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    assert report["versions_after"] == [2, 5], report
    return uri


def _cli(capsys, uri: str, *argv: str) -> tuple[int, list[str]]:
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={Path(uri).parent}"])
    return code, capsys.readouterr().err.strip().splitlines()


# -- 1: a garbage-collected version is named as such -----------------------------------------------

@pytest.mark.parametrize("version", [1, 3, 4])
def test_garbage_collected_version_is_named_with_the_oldest_kept(collected, version):
    """It was "has no version 3 (the latest is 5 ...)", as for a version that never existed."""
    with pytest.raises(StoreError) as info:
        store.dataset(collected, store.FEATURES, version)
    msg = str(info.value)
    assert f"no longer has version {version}: it was garbage-collected" in msg, msg
    assert "the oldest version kept is 2, the latest 5" in msg, msg


def test_version_past_the_latest_is_still_no_such_version(collected):
    with pytest.raises(StoreError) as info:
        store.dataset(collected, store.FEATURES, 6)
    assert "has no version 6 (the latest is 5;" in str(info.value) and "garbage" not in str(info.value)


@pytest.mark.parametrize("verb", [["checkout", "--v", "3"], ["restore", "--v", "3"], ["diff", "--a", "3", "--b", "5"]])
def test_cli_verbs_on_a_garbage_collected_version_are_one_line(collected, capsys, verb):
    code, err = _cli(capsys, collected, *verb)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    assert "no longer has version 3: it was garbage-collected" in err[0], err
    assert [v["version"] for v in versions.list_versions(collected, store.FEATURES)] == [2, 5]  # restore: nothing made


# -- 3: a store whose pins cannot be written --------------------------------------------------------

def _pins_fail(monkeypatch, code: int) -> None:
    """Creating a pin file fails with ``code`` (as root, chmod -w does not stop writes: simulated)."""
    real = os.open

    def fake_open(path, *args, **kw):
        if f"{os.sep}.eaglenest{os.sep}pins{os.sep}" in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, *args, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(lease, "_unpinned_tables", set())


def _pin_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "pin" in r.getMessage()]


def test_unwritable_store_warns_once_per_table_not_per_read(collected, monkeypatch, caplog):
    """Each read (a training run opens its version more than once, verify and query each pin) warned again."""
    _pins_fail(monkeypatch, errno.EACCES)
    with caplog.at_level(logging.DEBUG, logger="eaglenest"):
        for _ in range(3):
            with lease.pin(collected, store.FEATURES, 5):
                pass
        assert maintenance.verify(collected, store.FEATURES)["ok"]
    warned = _pin_warnings(caplog)
    assert len(warned) == 1, warned
    assert "cannot pin versions of table 'features'" in warned[0] and "Permission denied" in warned[0], warned


def test_read_only_file_system_reads_without_a_pin_warning(collected, monkeypatch, caplog):
    """No gc can run on a read-only mount: a pin is impossible by design, and not worth a warning."""
    _pins_fail(monkeypatch, errno.EROFS)
    with caplog.at_level(logging.DEBUG, logger="eaglenest"):
        with lease.pin(collected, store.FEATURES, 5):
            pass
        assert maintenance.verify(collected, store.FEATURES)["ok"]
    assert _pin_warnings(caplog) == []


# -- 2: gc on object storage and reader pins ----------------------------------------------------------

def test_gc_on_object_storage_says_pins_are_not_honoured(s3, caplog, tmp_path, monkeypatch):
    """gc there silently ignored pins (and looked for them in a folder named 's3:' under the working directory)."""
    monkeypatch.chdir(tmp_path)
    uri, m = s3.uri("gc-pins"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    with caplog.at_level(logging.WARNING, logger="eaglenest"):
        report = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    warned = [r.getMessage() for r in caplog.records if "reader pins do not exist on object storage" in r.getMessage()]
    assert len(warned) == 1 and "table 'features' in s3://" in warned[0], caplog.records
    assert report["versions_after"] == [2] and report["pinned_versions_kept"] == []
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("step, code", [("lockf", errno.ENOLCK), ("pwrite", errno.ENOSPC)])
def test_pin_that_cannot_be_locked_or_written_is_a_warning_not_a_traceback(collected, monkeypatch, caplog,
                                                                            step, code):
    """A pin file that opened but could not be locked (NFS without its lock manager) or written (a full
    disk) raised the bare OSError out of every read that pins: a training run, verify, query, export."""
    import fcntl

    real = {"lockf": fcntl.lockf, "pwrite": os.pwrite}[step]

    def failing(fd, *args):
        if f"{os.sep}.eaglenest{os.sep}pins{os.sep}" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    monkeypatch.setattr(fcntl if step == "lockf" else os, step, failing)
    monkeypatch.setattr(lease, "_unpinned_tables", set())
    with caplog.at_level(logging.WARNING, logger="eaglenest"):
        report = maintenance.verify(collected, store.FEATURES)
    assert report["ok"] and report["version"] == 5, report
    warned = _pin_warnings(caplog)
    assert len(warned) == 1 and os.strerror(code) in warned[0], warned
    assert list((Path(collected) / ".eaglenest" / "pins" / "features").iterdir()) == []  # no half-made pin left


# -- nulls in a write -------------------------------------------------------------------------------

def _nullable(m) -> pa.Schema:
    """The features schema with every field (and list item) nullable: how a caller's own table comes."""
    return pa.schema([pa.field(f.name, pa.list_(f.type.value_type) if pa.types.is_list(f.type) else f.type)
                      for f in S.features_schema(m)])


@pytest.mark.parametrize("column, row, value, says", [
    ("sample_id", 0, None, "column 'sample_id' is null in row 0"),
    ("domain", 1, None, "column 'domain' is null in row 1"),
    ("aux_hidden", 1, None, "column 'aux_hidden' is null in row 1"),
    ("input_ids", 1, [1, None, 3, 4, 5], "column 'input_ids' holds a null item in row 1"),
    ("loss_mask", 0, [0, 1, None, 1], "column 'loss_mask' holds a null item in row 0"),
])
def test_null_in_a_write_is_named_and_nothing_is_written(tmp_path, column, row, value, says):
    """A null cell was pyarrow's ValueError ("Casting field ... with null values to non-nullable", a
    traceback); a null token id or loss-mask item inside a list was stored as it was."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    rows = H.rows(["c", "d"], m)
    rows[row][column] = value
    with pytest.raises(SchemaError) as info:
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=_nullable(m)), meta=m)
    assert f"write to 'features': {says}" in str(info.value) and "nothing was written" in str(info.value), info.value
    assert store.latest_version(uri, store.FEATURES) == 2 and store.sample_ids(uri, store.FEATURES) == {"a"}


# -- gc and the on-policy guard -------------------------------------------------------------------------

def test_gc_keeps_the_prompts_lineage_the_on_policy_guard_reads(tmp_path):
    """The guard reads which target generated the responses from each ingest commit's lineage; gc removed
    those versions (a compact made the latest one, which records none), so a capture with another target
    went on with a warning that the table was "written before eaglenest recorded it"."""
    import interop_helpers as I
    from eaglenest.errors import ConfigError
    from eaglenest.featurestore.capture import policy

    a, b = I.tiny_target(tmp_path / "A", seed=0), I.tiny_target(tmp_path / "B", seed=1)
    uri, rows = H.prompts_store(tmp_path, H.prompt_rows(3), a), H.prompt_rows(6)[3:]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 1, **policy.lineage_record(a)})
    maintenance.compact(uri, store.PROMPTS)
    report = maintenance.gc(uri, store.PROMPTS, older_than_hours=0)
    assert len(report["versions_after"]) == 1, report  # only the compacted version is left
    with pytest.raises(ConfigError) as info:
        policy.check_prompts(uri, b, off_policy=False, stage="featurestore capture")
    assert f"were generated by {a}" in str(info.value) and f"run.target is {b}" in str(info.value), info.value
    policy.check_prompts(uri, a, off_policy=False, stage="featurestore capture")  # its own target still passes
