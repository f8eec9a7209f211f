"""The trainer's read path refuses damaged feature files (featurestore.integrity, reader, FeatureShards).

A small features table of synthetic rows (tests/featurestore/fs_helpers.py), then: 16 flipped bytes
in the middle of a data file (size kept), a truncated file, a flip with the mtime put back, an
untouched table (reads identically; a second check reads no file), a copied store (one full
re-check, then stamps), a data file without its checksum sidecar (warned, read), a version-1 table,
and one end-to-end ``train run`` on a tiny target: exit 0 clean, exit 2 with one line once damaged.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

FS_TESTS = Path(__file__).resolve().parents[1] / "featurestore"
if str(FS_TESTS) not in sys.path:
    sys.path.insert(0, str(FS_TESTS))

import fs_helpers as H  # noqa: E402

from eaglenest.errors import StoreError  # noqa: E402
from eaglenest.featurestore.table import integrity, maintenance, store  # noqa: E402
from eaglenest.featurestore import schema as S  # noqa: E402
from eaglenest.train.data import FeatureShards  # noqa: E402

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def _write(uri: str, m=None, *, commits: int = 2) -> list:
    m = m or H.meta(hidden=32)
    for c in range(commits):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(5)], m, num_tokens=6, seed=c), meta=m)
    ds = store.dataset(uri, store.FEATURES)
    return [(f.fragment_id, store.table_path(uri, store.FEATURES) / "data" / df.path)
            for f in ds.get_fragments() for df in f.data_files()]


@pytest.fixture()
def table(tmp_path):
    uri = str(tmp_path / "store")
    return uri, _write(uri)


def _shards(uri: str) -> FeatureShards:
    return FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=2, seed=0)


def _read_all(uri: str) -> list:
    """Every batch of one epoch through the trainer's reader (what `train run` reads)."""
    shards = _shards(uri)
    try:
        return [shards.read(rows) for rows in shards.plan(0)]
    finally:
        shards.reader.close()


def _flip(path: Path, *, keep_mtime: bool = False) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        chunk = f.read(16)
        f.seek(st.st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size


def _assert_names(exc: StoreError, fid: int, path: Path) -> None:
    msg = str(exc)
    assert "\n" not in msg and f"fragment {fid}" in msg and str(path) in msg and "featurestore verify" in msg, msg


def _counting(monkeypatch) -> list:
    seen = []
    real = integrity.crc_and_stat

    def crc_and_stat(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(integrity, "crc_and_stat", crc_and_stat)
    return seen


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["flip", "flip-mtime-restored"])
def test_flipped_bytes_stop_the_trainer(table, keep_mtime):
    uri, files = table
    fid, path = files[1]
    _flip(path, keep_mtime=keep_mtime)
    with pytest.raises(StoreError, match="fails its checksum") as err:
        _read_all(uri)
    _assert_names(err.value, fid, path)
    assert not maintenance.verify(uri, store.FEATURES)["ok"]  # verify agrees, unchanged


def test_flip_after_a_trusted_check_is_caught(table):
    """A stamp recorded by a clean check does not hide a later flip (ctime moves on)."""
    uri, files = table
    _read_all(uri)
    fid, path = files[0]
    _flip(path, keep_mtime=True)
    with pytest.raises(StoreError, match="fails its checksum") as err:
        _read_all(uri)
    _assert_names(err.value, fid, path)


def test_truncated_file_stops_the_trainer(table):
    uri, files = table
    fid, path = files[1]
    os.truncate(path, os.stat(path).st_size // 2)
    with pytest.raises(StoreError) as err:
        _read_all(uri)
    _assert_names(err.value, fid, path)


def test_truncation_after_the_check_names_the_fragment(table):
    """Damage between the check and the reads (or with the check off): a Lance error or a short
    pread is still one StoreError naming the fragment and file, not a traceback."""
    uri, files = table
    shards = _shards(uri)
    try:
        for fid, path in files:
            os.truncate(path, os.stat(path).st_size // 2)
        with pytest.raises(StoreError) as err:
            for rows in shards.plan(0):
                shards.read(rows)
    finally:
        shards.reader.close()
    assert "\n" not in str(err.value) and "fragment" in str(err.value) and "data file" in str(err.value)
    assert any(f"fragment {fid}" in str(err.value) and str(p) in str(err.value) for fid, p in files)


def test_untouched_table_reads_identically_and_second_check_reads_nothing(table, monkeypatch):
    uri, files = table
    from eaglenest.featurestore.read.reader import SampleReader

    ds = store.dataset(uri, store.FEATURES)
    with SampleReader(ds, integrity="off") as plain, SampleReader(ds) as checked:
        rows = list(range(ds.count_rows()))
        got_plain, got_checked = list(plain.read(rows)), list(checked.read(rows))
        assert len(rows) > 0 and [a.index for a in got_plain] == [b.index for b in got_checked] == rows
        for a, b in zip(got_plain, got_checked, strict=True):
            assert torch.equal(a.aux_stored(), b.aux_stored()) and torch.equal(a.last_stored(), b.last_stored())
    seen = _counting(monkeypatch)
    first = integrity.check_version(ds)  # the commit's stamps, or one re-read if the commit was racy
    assert first.files == len(files) and first.trusted + first.rechecked == len(files) and not first.unchecked
    for _, path in files:
        assert integrity.stamp_path(path.parents[1] / integrity.CRC_DIR, path.name).is_file()
    seen.clear()
    again = integrity.check_version(store.dataset(uri, store.FEATURES))
    assert (again.trusted, again.rechecked, seen) == (len(files), 0, [])
    batches = _read_all(uri)
    assert seen == [] and sum(int((b.doc_ids >= 0).sum()) for b in batches) > 0


def test_copied_store_is_rechecked_once_then_trusted(table, tmp_path, monkeypatch):
    uri, files = table
    reference = _read_all(uri)
    copy = str(tmp_path / "copy")
    shutil.copytree(uri, copy)  # new inodes and ctimes: every stamp is stale
    seen = _counting(monkeypatch)
    copied = _read_all(copy)
    assert sorted(seen) == sorted(p.name for _, p in files)  # one full re-check, through the trainer
    assert len(copied) == len(reference) > 0
    for a, b in zip(reference, copied, strict=True):
        assert torch.equal(a.aux, b.aux) and torch.equal(a.last_hidden, b.last_hidden)
    seen.clear()
    _read_all(copy)
    assert seen == []  # stamps rewritten: trusted by stat


def test_sidecar_missing_warns_and_reads(table, caplog):
    uri, files = table
    _, path = files[0]
    (path.parents[1] / integrity.CRC_DIR / f"{path.name}.crc").unlink()
    with caplog.at_level(logging.WARNING, logger="eaglenest.featurestore.table.integrity"):
        assert _read_all(uri) and _read_all(uri)
    assert sum("1 of 2 data files have no checksum sidecar" in r.getMessage() for r in caplog.records) == 1
    report = integrity.check_version(store.dataset(uri, store.FEATURES))
    assert report.unchecked == [path.name]
    assert report.trusted == len(files) - 1


def test_version1_table_is_checked(tmp_path):
    """Inline (schema version 1) tables: read through take, held to the same checksums."""
    import lance
    import pyarrow as pa

    uri = str(tmp_path / "v1")
    m = H.meta(hidden=32)
    schema = pa.schema([pa.field(f.name, f.type, nullable=f.nullable) for f in S.FEATURES_SCHEMA],
                       metadata={**S.features_schema(m).metadata, b"eaglenest.schema_version": b"1"})
    lance.write_dataset(pa.Table.from_pylist(H.rows([f"s{i}" for i in range(6)], m, num_tokens=6), schema=schema),
                        str(store.table_path(uri, store.FEATURES)), schema=schema, data_storage_version="2.0")
    ds = store.dataset(uri, store.FEATURES)
    assert S.tensor_layout(ds.schema) == "inline"
    integrity.record_checksums(uri, store.FEATURES, ds.get_fragments())
    assert _read_all(uri)
    (frag,) = ds.get_fragments()
    path = store.table_path(uri, store.FEATURES) / "data" / frag.data_files()[0].path
    _flip(path)
    with pytest.raises(StoreError, match="fails its checksum") as err:
        _read_all(uri)
    _assert_names(err.value, frag.fragment_id, path)


def _synth():
    spec = importlib.util.spec_from_file_location(
        "_eaglenest_test_synth", Path(__file__).resolve().parents[1] / "train" / "synth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_train_run_exits_2_on_a_damaged_store(tmp_path, capsys):
    from eaglenest.pipeline.train_cli import main as train_main

    synth = _synth()
    target = synth.make_target(tmp_path / "tiny-target")
    uri = str(tmp_path / "store")
    synth.write_features(uri, target, synth.greedy_sequences(target, n=6, prompt_len=8, gen_len=8))
    common = ["run", "--recipe", RECIPE, f"run.target={target}", f"run.store={uri}", "train.num_steps=1",
              "train.draft_vocab_size=64", "train.ttt_steps=1"]
    assert train_main([*common, f"run.workdir={tmp_path / 'clean'}"]) == 0
    capsys.readouterr()
    ds = store.dataset(uri, store.FEATURES)
    (frag,) = ds.get_fragments()
    path = store.table_path(uri, store.FEATURES) / "data" / frag.data_files()[0].path
    _flip(path)
    assert train_main([*common, f"run.workdir={tmp_path / 'damaged'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train: error:"), err
    assert f"fragment {frag.fragment_id}" in err[0] and str(path) in err[0] and "fails its checksum" in err[0]
    assert not (tmp_path / "damaged" / "train" / "provenance.json").exists()


def test_racy_stamp_is_not_written(table):
    """A stamp whose ctime is not strictly older than the probe (same clock tick) would let a write in
    that tick hide: it is refused, and the file is simply re-read next time."""
    _, files = table
    _, path = files[0]
    crc_dir = path.parents[1] / integrity.CRC_DIR
    integrity.stamp_path(crc_dir, path.name).unlink(missing_ok=True)
    crc, st = integrity.crc_and_stat(path)
    assert not integrity.write_stamp(crc_dir, path.name, integrity.Stamp.of(st, crc), probe_ns=st.st_ctime_ns)
    assert not integrity.stamp_path(crc_dir, path.name).exists()
    assert integrity.write_stamp(crc_dir, path.name, integrity.Stamp.of(st, crc), probe_ns=st.st_ctime_ns + 1)


def test_read_only_store_remembers_checks_in_memory(table, monkeypatch):
    uri, files = table
    for _, path in files:
        integrity.stamp_path(path.parents[1] / integrity.CRC_DIR, path.name).unlink()
    monkeypatch.setattr(integrity, "fs_now_ns", lambda folder: None)  # as on a read-only mount
    monkeypatch.setattr(integrity, "_MEMORY", {})
    time.sleep(1.1)  # the in-memory rule wants ctimes older than 1 s by the wall clock
    seen = _counting(monkeypatch)
    _read_all(uri)
    assert sorted(seen) == sorted(p.name for _, p in files)
    seen.clear()
    _read_all(uri)
    assert seen == [] and not any(integrity.stamp_path(p.parents[1] / integrity.CRC_DIR, p.name).exists()
                                  for _, p in files)
