"""Mutation audit of the read path (qa9): behaviours no earlier test pinned, each checked against an
independent reference (the arrays written, decoded with numpy; row counts per fragment; the plan's
samples counted by hand).

Short reads (a network file system, a signal) and cold ``O_DIRECT`` reads are real conditions the
reader must survive bit for bit; they are produced here by capping what ``os.preadv`` returns per call
(the kernel may return less than asked) and by dropping the files' pages from the page cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import pread
from eaglenest.featurestore.read.pread import BufferPool
from eaglenest.featurestore.read.profile import ReadProfile
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.read.sample import Into
from eaglenest.featurestore.table import integrity, lease, store
from eaglenest.train import data as D

import fs_helpers as H  # on sys.path via conftest


def _table(m, sizes: list[int], seed: int = 0, prefix: str = "r"):
    """Rows of ``sizes`` tokens with random states in ``m.dtype``, and the states as float32 (the reference)."""
    rng = np.random.default_rng(seed)
    rows, ref = [], []
    for k, T in enumerate(sizes):
        aux = rng.standard_normal((T, len(m.layer_ids), m.hidden_size)).astype(np.float32)
        last = rng.standard_normal((T, m.hidden_size)).astype(np.float32)
        enc = {}
        if m.dtype == "bfloat16":  # stored as bf16 bit patterns; the reference holds what bf16 keeps
            for name, a in (("aux", aux), ("last", last)):
                enc[name] = torch.from_numpy(a).bfloat16().view(torch.int16).numpy().view(np.uint16)
            aux, last = (torch.from_numpy(enc[n].view(np.int16)).view(torch.bfloat16).float().numpy()
                         for n in ("aux", "last"))
        ref.append((aux, last))
        rows.append({"sample_id": f"{prefix}{k}", "domain": "d", "source": "s", "split": "train", "mode": "chat",
                     "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": T - 1,
                     "input_ids": [(3 * k + j) % 97 for j in range(T)], "loss_mask": [0] + [1] * (T - 1),
                     "aux_hidden": S.encode_value(enc.get("aux", aux), m),
                     "last_hidden": S.encode_value(enc.get("last", last), m)})
    return pa.Table.from_pylist(rows, schema=S.features_schema(m)), ref


def _store(tmp_path, m, commits: list[list[int]]):
    uri, ref = str(tmp_path / "store"), []
    for c, sizes in enumerate(commits):
        t, r = _table(m, sizes, seed=c, prefix=f"c{c}-")
        store.append(uri, store.FEATURES, t, meta=m)
        ref += r
    return uri, ref


def _short_reads(monkeypatch, cap: int) -> list:
    """``os.preadv`` returning at most ``cap`` bytes a call, as the kernel may; the calls' flags are recorded."""
    real, flags = os.preadv, []

    def preadv(fd, buffers, offset, *args):
        flags.append(args[0] if args else 0)
        left, capped = cap, []
        for b in buffers:
            mv = memoryview(b).cast("B")
            if left <= 0:
                break
            capped.append(mv[:left])
            left -= len(capped[-1])
        return real(fd, capped, offset, *args)

    monkeypatch.setattr(pread.os, "preadv", preadv)
    return flags


@pytest.mark.parametrize("direct", [False, True])
def test_short_reads_are_resumed_where_they_stopped(tmp_path, monkeypatch, direct):
    """Each read (a value into a buffer, straight into a destination, the scatter read that reorders the
    layers, a page-cache try) may return fewer bytes than asked: the rest is read from where it stopped,
    never from the value's start again, and a partial page-cache hit is not taken for the value."""
    m = H.meta(dtype="float32", hidden=96, layer_ids=(5, 2, 4))
    uri, ref = _store(tmp_path, m, [[7, 3], [5]])
    _short_reads(monkeypatch, cap=1000)  # no value or layer run is a multiple of it
    with SampleReader(store.dataset(uri, store.FEATURES), direct=direct, recycle=True) as r:
        for k, s in enumerate(r.iter_samples([2, 0, 1])):
            want = ref[[2, 0, 1][k]]
            assert np.array_equal(s.aux_stored().numpy(), want[0]) and np.array_equal(s.last_stored().numpy(), want[1])
            s.release()
        order = [1, 2, 0]  # ascending layer ids: a scatter read with one run per layer
        for i in (0, 2):
            T = ref[i][0].shape[0]
            dest = Into(aux=torch.full((T - 1, 3, 96), 7.0), last=torch.full((T - 1, 96), 7.0), order=order)
            r.read([i], into=[dest])
            assert np.array_equal(dest.aux.numpy(), ref[i][0][:T - 1][:, order])
            assert np.array_equal(dest.last.numpy(), ref[i][1][:T - 1])


def _drop_cache(uri: str) -> None:
    for path in (Path(uri) / "features.lance" / "data").iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_cold_direct_reads_take_the_unaligned_value_out_of_its_aligned_blocks(tmp_path):
    """``direct=True`` on a cold file reads whole aligned blocks with ``O_DIRECT`` (where the file system
    takes it) and hands out the value's own bytes from within them, bit for bit."""
    m = H.meta(dtype="bfloat16", hidden=1000, layer_ids=(2, 4, 5))
    # Values of 0.2-1.2 MiB, beyond the kernel's readahead of the small columns that Lance reads first (so
    # most are read from the disk), and not whole sectors: Lance packs them back to back, so most start
    # off even a 512-byte boundary, where the file system refuses an O_DIRECT read.
    uri, ref = _store(tmp_path, m, [[101, 57, 77], [33]])
    try:
        os.close(os.open(next((Path(uri) / "features.lance" / "data").iterdir()), os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT (tmpfs): the path checked here does not run")
    prof = ReadProfile()
    with SampleReader(store.dataset(uri, store.FEATURES), direct=True, recycle=True, profile=prof) as r:
        _drop_cache(uri)
        for k, s in enumerate(r.iter_samples([3, 1, 0, 2])):
            want = ref[[3, 1, 0, 2][k]]
            assert torch.equal(s.aux_stored().float(), torch.from_numpy(want[0]))
            assert torch.equal(s.last_stored().float(), torch.from_numpy(want[1]))
            s.release()
    # Every value by O_DIRECT (or from the page cache): none fell back to a plain pread, which is what
    # follows an O_DIRECT read the file system refused (EINVAL: an unaligned offset, length or buffer).
    assert any(name.startswith("pread O_DIRECT") for name in prof.calls), dict(prof.calls)
    assert not any(name.startswith("pread into") for name in prof.calls), dict(prof.calls)


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_that_ends_inside_a_value_is_an_error_naming_it(tmp_path, monkeypatch, direct):
    """A read that returns nothing before the value is whole (the file ends there: truncated after the
    check) is an error naming the file, by every read path, never a sample of whatever the buffer held."""
    m = H.meta(dtype="float32", hidden=64)
    uri, _ = _store(tmp_path, m, [[40, 30]])
    (path,) = (Path(uri) / "features.lance" / "data").iterdir()
    with SampleReader(store.dataset(uri, store.FEATURES), direct=direct, recycle=True) as r:
        _drop_cache(uri)
        monkeypatch.setattr(pread.os, "preadv", lambda fd, buffers, offset, *flags: 0)  # end of file
        for into in (None, [Into(aux=torch.empty(30, 3, 64), last=torch.empty(30, 64))]):
            with pytest.raises(StoreError, match="short of a blob value") as err:
                for s in r.iter_samples([1], into=into):
                    s.release()
            assert str(path) in str(err.value)


def test_pool_buffers_hold_what_is_asked_and_the_smallest_idle_ones_go_first():
    for n in [1, 4095, 4096, 4097, 65537, (8 << 20) - 1, 8 << 20, (8 << 20) + 1, (24 << 20) + 5]:
        size = BufferPool.rounded(n)
        assert size >= n and (size % BufferPool.STEP == 0 if n >= BufferPool.STEP else size & (size - 1) == 0)
        assert size < 2 * max(n, 4096) or size - n < BufferPool.STEP
    pool = BufferPool(max_bytes=20 << 20)
    bufs = [pool.get(n)[0] for n in (4096, 16 << 20, 8 << 20)]
    for b in bufs:
        pool.put(b)
    assert sorted(b.size for b in pool._free) == [16 << 20]  # the smallest dropped until within max_bytes
    got, reused = pool.get(10 << 20)
    assert reused and got.size == 16 << 20


def test_a_read_error_names_the_fragment_each_row_lives_in():
    """The rows of fragment k are the offsets from the rows before it up to its own count: an offset at a
    fragment's first row is that fragment's, not the one before."""

    class Frag:
        def __init__(self, fid, n):
            self.fragment_id, self.n = fid, n

        def count_rows(self):
            return self.n

    class Ds:
        def get_fragments(self):
            return [Frag(10, 2), Frag(11, 3), Frag(12, 1)]

    owner = [10, 10, 11, 11, 11, 12]  # by hand
    for offset, fid in enumerate(owner):
        assert integrity.fragments_of_offsets(Ds(), [offset]) == [fid]
    assert integrity.fragments_of_offsets(Ds(), [1, 2, 5]) == [10, 11, 12]


def test_a_sidecar_that_disagrees_with_the_stamp_is_not_trusted(tmp_path):
    """The stamp caches a CRC the file had; it vouches for the file only while it equals the sidecar (the
    CRC recorded at commit). A sidecar holding another CRC (restored from elsewhere, edited) makes the file
    be read again and refused."""
    m = H.meta()
    uri, _ = _store(tmp_path, m, [[4, 5]])
    ds = store.dataset(uri, store.FEATURES)
    integrity.check_version(ds)  # stamps written
    (path,) = (Path(uri) / "features.lance" / "data").iterdir()
    crc_dir = Path(uri) / "features.lance" / integrity.CRC_DIR
    assert integrity.read_stamp(crc_dir, path.name) is not None
    sidecar = crc_dir / f"{path.name}.crc"
    good = sidecar.read_text()
    sidecar.write_text(f"{int(good, 16) ^ 1:08x}")
    with pytest.raises(StoreError, match="fails its checksum"):
        integrity.check_version(ds)


def test_a_layer_order_with_a_negative_position_is_refused(tmp_path):
    """Python would take position -1 as the last layer: a wrong order reads the wrong layer silently."""
    m = H.meta(dtype="bfloat16", layer_ids=(2, 4, 5))
    uri, _ = _store(tmp_path, m, [[4]])
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        for dtype in (torch.bfloat16, torch.float32):
            with pytest.raises(SchemaError, match="outside the table's 3 aux layers"):
                r.read([0], into=[Into(aux=torch.empty(4, 3, 8, dtype=dtype), last=torch.empty(4, 8, dtype=dtype),
                                       order=[-1, 0, 1])])


def test_shards_read_the_version_they_pinned_when_a_writer_commits_meanwhile(tmp_path, monkeypatch):
    """A writer's commit between the open and the pin: the shards read the version they opened and
    pinned, every row of it and no row of the later one."""
    m = H.meta()
    uri, _ = _store(tmp_path, m, [[4, 5, 6]])
    real = lease.pin

    def pin_after_a_commit(uri_, name, version, **kw):
        store.append(uri, store.FEATURES, _table(m, [3, 3], seed=9, prefix="late-")[0], meta=m)
        return real(uri_, name, version, **kw)

    monkeypatch.setattr(lease, "pin", pin_after_a_commit)
    shards = D.FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=4, seed=0)
    try:
        assert shards.ds.version == shards.version == 2 and store.latest_version(uri, store.FEATURES) == 3
        assert shards.num_rows == 3 and shards.reader.num_rows == 3
        seen = sorted(i for rows in shards.plan(0) for row in rows for i in row)
        assert seen == [0, 1, 2]
    finally:
        shards.close()


def test_padding_of_a_reused_batch_arena_is_zero(tmp_path):
    """Batch memory is reused once no tensor holds it: the padding of a row shorter than the batch must
    be zeros, not the previous batch's states."""
    m = H.meta(hidden=16)
    uri, ref = _store(tmp_path, m, [[12, 12, 3, 9]])
    shards = D.FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=2, seed=0)
    try:
        first = shards.read([[0], [1]])  # every position filled
        del first
        b = shards.read([[2], [3]])  # row 0: 3 tokens, then 6 of padding
        assert shards._arenas.allocated == 1  # the first batch's memory, reused
        assert torch.equal(b.aux[0, 3:], torch.zeros(6, 3 * 16))
        assert torch.equal(b.last_hidden[0, 3:], torch.zeros(6, 16))
        assert torch.equal(b.aux[0, :3].view(3, 3, 16), torch.from_numpy(ref[2][0]))
        assert b.doc_ids[0].tolist() == [0] * 3 + [-1] * 6 and b.loss_mask[0, 3:].sum() == 0
    finally:
        shards.close()


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_every_sample_is_trained_once_per_epoch_whatever_the_world_size(world_size):
    """Across the ranks, the rows that carry a loss (not ghosts) hold each eligible sample exactly once
    an epoch; and each epoch shuffles anew."""
    lengths = np.array([5, 30, 7, 12, 64, 3, 9, 40, 2, 18, 25])
    orders = []
    for epoch in range(3):
        plan = D.plan_batches(lengths, pack_tokens=48, batch_rows=3, seed=4, epoch=epoch, row_tokens=40)
        counts = np.zeros(len(lengths), int)
        for rows in plan:
            for rank in range(world_size):
                mine, ghost = D.rank_rows(rows, rank, world_size)
                if not ghost:
                    for row in mine:
                        counts[row] += 1
        assert counts.tolist() == [1] * len(lengths)
        orders.append([i for rows in plan for row in rows for i in row])
    assert orders[0] != orders[1] and orders[1] != orders[2]


def test_the_window_measures_a_period_of_twice_its_size_before_it_moves():
    """A rate measured over fewer deliveries than two windows' worth is mostly one burst of completions:
    each period is ``max(min_period, 2 * size)`` deliveries (the first delivery only starts the clock)."""
    from eaglenest.featurestore.read.window import AdaptiveWindow

    for size in (1, 3, 6):
        w = AdaptiveWindow(start=size, lo=size, hi=size, budget=1 << 40, min_period=4)
        period = max(4, 2 * size)
        now = 0.0
        w.record(1 << 20, now=now)  # starts the clock
        for k in range(1, 3 * period + 1):
            now += 0.01
            w.record(1 << 20, now=now)
            assert len(w.history) == k // period, (size, k, w.history)
        assert [s for s, _ in w.history] == [size] * 3


def test_a_file_that_changes_while_its_crc_is_computed_gets_no_stamp(tmp_path, monkeypatch):
    """The CRC of a file that changed during the read may be of neither its old nor its new bytes: no stamp
    may vouch for it (``crc_and_stat`` gives no stat), so the next check reads it again."""
    import time
    import types
    import zlib

    path = tmp_path / "data.lance"
    path.write_bytes(bytes(range(256)) * 64)
    time.sleep(0.05)  # the change below lands in a later clock tick than the file's creation
    changed = []

    def crc32(data, value=0):  # a writer changes the file while it is being read
        if not changed:
            with open(path, "r+b") as f:
                f.seek(10)
                f.write(b"\xff")
            changed.append(True)
        return zlib.crc32(data, value)

    monkeypatch.setattr(integrity, "zlib", types.SimpleNamespace(crc32=crc32))
    _, st = integrity.crc_and_stat(path)
    assert changed and st is None
    monkeypatch.setattr(integrity, "zlib", zlib)
    crc, st = integrity.crc_and_stat(path)  # unchanged during this read: its stat vouches for this CRC
    assert st is not None and crc == f"{zlib.crc32(path.read_bytes()):08x}"


def test_a_read_only_store_does_not_remember_a_file_changed_within_the_last_second(tmp_path, monkeypatch):
    """Without a stamp (a read-only store), a check is remembered in memory only for a file whose ctime is
    over a second old by the wall clock: a change within the same filesystem tick could hide otherwise."""
    m = H.meta()
    uri, _ = _store(tmp_path, m, [[4]])
    (path,) = (Path(uri) / "features.lance" / "data").iterdir()
    integrity.stamp_path(path.parents[1] / integrity.CRC_DIR, path.name).unlink()
    monkeypatch.setattr(integrity, "fs_now_ns", lambda folder: None)  # as on a read-only mount
    monkeypatch.setattr(integrity, "_MEMORY", {})
    ds = store.dataset(uri, store.FEATURES)
    os.utime(path)  # its ctime: now
    assert integrity.check_version(ds).rechecked == 1
    assert integrity._MEMORY == {}
    assert integrity.check_version(ds).rechecked == 1  # read again, not trusted


def test_a_stamped_file_of_another_size_is_named_truncated_without_reading_it(tmp_path, monkeypatch):
    """Data files are immutable: a size unlike the stamp's is damage, said so (truncated or overwritten) at
    the cost of a ``stat``, not a CRC pass over what is left."""
    m = H.meta()
    uri, _ = _store(tmp_path, m, [[4, 5]])
    ds = store.dataset(uri, store.FEATURES)
    integrity.check_version(ds)
    (path,) = (Path(uri) / "features.lance" / "data").iterdir()
    size = os.path.getsize(path)
    os.truncate(path, size - 1)
    read = []
    monkeypatch.setattr(integrity, "crc_and_stat", lambda p: read.append(p))
    with pytest.raises(StoreError, match=rf"is {size - 1} bytes, {size} when its checksum was recorded \(truncated"):
        integrity.check_version(ds)
    assert read == []


def test_rows_without_a_loss_token_or_of_another_split_are_never_planned(tmp_path):
    """A row with nothing to learn (loss mask all 0) would take a place in a row and a read, and a batch of
    only such rows has no loss at all; a row of another split is not this run's data."""
    m = H.meta()
    rows = H.rows([f"s{i}" for i in range(6)], m, num_tokens=5)
    for k in (1, 4):
        rows[k]["loss_mask"] = [0] * rows[k]["num_tokens"]
        rows[k]["num_loss_tokens"] = 0
    rows[2]["split"] = "eval"
    uri = str(tmp_path / "store")
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    shards = D.FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=2, seed=0)
    try:
        assert shards.offsets.tolist() == [0, 3, 5]
        assert sorted(i for b in shards.plan(0) for r in b for i in r) == [0, 1, 2]
        batches = [shards.read(b) for b in shards.plan(0)]
        assert sum(int(b.loss_mask.sum()) for b in batches) == sum(rows[k]["num_loss_tokens"] for k in (0, 3, 5))
        assert sum(int((b.doc_ids >= 0).sum()) for b in batches) == sum(rows[k]["num_tokens"] for k in (0, 3, 5))
    finally:
        shards.close()


def test_a_reader_sees_its_version_exactly_while_a_writer_appends(tmp_path):
    """Snapshot isolation: rows committed after the reader opened its version are not there (not in its
    count, not at the next offsets), and the version's own rows read back as written."""
    m = H.meta(hidden=16)
    uri, ref = _store(tmp_path, m, [[4, 6]])
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        store.append(uri, store.FEATURES, _table(m, [5, 5, 5], seed=7, prefix="late-")[0], meta=m)
        assert r.num_rows == 2 and store.dataset(uri, store.FEATURES).count_rows() == 5
        for k, s in enumerate(r.iter_samples([1, 0])):
            assert np.array_equal(s.aux_stored().numpy(), ref[1 - k][0])
            assert np.array_equal(s.last_stored().numpy(), ref[1 - k][1])
            s.release()
        with pytest.raises(StoreError, match=r"row 2 is out of range \(the version has 2 rows"):
            r.take(2)
