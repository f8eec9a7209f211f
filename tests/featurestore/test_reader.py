"""The fast read path (featurestore.reader, train.data.FeatureShards.read) against plain reference
decodes, schema versions 1 and 2, and fp8_e4m3 storage (round-trip error, bytes per token)."""

import os
import random
import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import maintenance, store
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.train.data import FeatureShards, collate

LAYERS = (5, 2, 4)  # not ascending: the trainer must reorder aux layers


def _meta(dtype="bfloat16", hidden=16, storage="raw"):
    return S.FeatureMeta(target="t", layer_ids=LAYERS, last_layer_id=8, hidden_size=hidden, dtype=dtype,
                         storage=storage, feature_set_id=f"fs-{dtype}-{storage}")


def _arrays(n, hidden, seed=0):
    """``n`` samples of 3-12 tokens; float32 aux/last with row scales spanning 1e-3..1e3."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        T = int(rng.integers(3, 13))
        scale = 10.0 ** rng.uniform(-3, 3, (T, len(LAYERS), 1))
        aux = (rng.standard_normal((T, len(LAYERS), hidden)) * scale).astype("f4")
        last = (rng.standard_normal((T, hidden)) * 10.0 ** rng.uniform(-3, 3, (T, 1))).astype("f4")
        out.append((f"s{k:02d}", rng.integers(0, 50, T).astype("i4"), aux, last))
    return out


def _stored(x, dtype):
    if dtype == "float16":  # float16 holds up to 65504: keep the test's row scales inside it
        return np.clip(x, -6e4, 6e4).astype("f2")
    t = torch.from_numpy(x).to({"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
    return t.view(torch.uint16).numpy() if dtype == "bfloat16" else t.numpy()


def _rows(samples, m):
    return [{"sample_id": sid, "domain": "d", "source": "s", "split": "train", "mode": "chat", "gen_params_id": "g",
             "num_tokens": len(ids), "num_loss_tokens": len(ids) - 1, "input_ids": ids.tolist(),
             "loss_mask": [0] + [1] * (len(ids) - 1),
             "aux_hidden": S.encode_value(_stored(aux, m.dtype), m),
             "last_hidden": S.encode_value(_stored(last, m.dtype), m)} for sid, ids, aux, last in samples]


def _write(uri, samples, m, *, commits=2):
    rows = _rows(samples, m)
    step = -(-len(rows) // commits)
    for i in range(0, len(rows), step):
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows[i:i + step], schema=S.features_schema(m)), meta=m)
    return rows


def _reference(uri, m, pack_tokens):
    """Plain decode of every row from store.read bytes (no reader code): the collate inputs."""
    order = np.argsort(np.asarray(m.layer_ids), kind="stable")
    out = []
    for r in store.read(uri, store.FEATURES).to_pylist():
        T, n = r["num_tokens"], min(r["num_tokens"], pack_tokens)
        if m.storage == "raw":
            aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), m.dtype).float()
            last = S.torch_from_blob(r["last_hidden"], (T, m.hidden_size), m.dtype).float()
        else:
            aux = S.decode_fp8(r["aux_hidden"], (T, 3, m.hidden_size))
            last = S.decode_fp8(r["last_hidden"], (T, m.hidden_size))
        out.append((torch.tensor(r["input_ids"][:n]), torch.tensor(r["loss_mask"][:n]).bool(),
                    aux[:n, order].reshape(n, -1), last[:n]))
    return out


def _assert_batches_equal(a, b):
    for f in ("input_ids", "loss_mask", "doc_ids", "position_ids", "aux", "last_hidden"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f


def _assert_pipelined_reads_equal(shards, ref):
    """An epoch's batches read as one pipelined stream (the trainer's prefetcher), an empty batch
    among them, equal collate of the plain decode."""
    plan = shards.plan(1)
    plan.insert(1, [])
    got = list(shards.read_batches(iter(plan)))
    assert len(got) == len(plan)
    for rows, batch in zip(plan, got):
        if rows:
            _assert_batches_equal(batch, collate([[ref[i] for i in row] for row in rows]))
        else:
            assert batch.input_ids.shape[0] == 0


@pytest.mark.parametrize("dtype,storage", [("bfloat16", "raw"), ("float32", "fp8_e4m3")])
def test_trainer_read_equals_collate_of_plain_decode(tmp_path, dtype, storage):
    m = _meta(dtype, storage=storage)
    uri = str(tmp_path)
    _write(uri, _arrays(9, m.hidden_size), m)
    ds = store.dataset(uri, store.FEATURES)
    assert S.tensor_layout(ds.schema) == "blob" and len(ds.get_fragments()) == 2
    ref = _reference(uri, m, pack_tokens=10)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=10, batch_rows=2, seed=3, read_threads=3)
    for rows in shards.plan(0):
        _assert_batches_equal(shards.read(rows), collate([[ref[i] for i in row] for row in rows]))
    _assert_pipelined_reads_equal(shards, ref)
    shards.reader.close()


def test_trainer_reads_run_across_batch_boundaries(tmp_path):
    """The next batch's first samples are read while this batch's last ones are still in flight: the
    reader's window does not drain at every batch boundary."""
    m = _meta("bfloat16")
    uri = str(tmp_path)
    _write(uri, _arrays(9, m.hidden_size), m)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=10, batch_rows=1, seed=3, read_threads=3)
    events, batch_of = [], {}
    plan = shards.plan(0)
    for k, rows in enumerate(plan):
        for i in (i for row in rows for i in row):
            batch_of[int(shards.offsets[i])] = k
    inner_read, inner_place = shards.reader._from_row, shards._place

    def read(g, k, index, *rest):
        events.append(("start", batch_of[index]))
        return inner_read(g, k, index, *rest)

    def place(lay, where, s):
        events.append(("placed", batch_of[s.index]))
        return inner_place(lay, where, s)

    shards.reader._from_row, shards._place = read, place
    try:
        assert len(list(shards.read_batches(plan))) == len(plan) >= 3
    finally:
        shards.reader.close()
    last_placed = {b: max(j for j, e in enumerate(events) if e == ("placed", b)) for b in range(len(plan))}
    first_start = {b: min(j for j, e in enumerate(events) if e == ("start", b)) for b in range(len(plan))}
    overlaps = sum(first_start[b + 1] < last_placed[b] for b in range(len(plan) - 1))
    assert overlaps >= 1, events


def test_reader_views_are_bit_exact_in_any_order(tmp_path):
    m = _meta("bfloat16")
    rows = _write(str(tmp_path), _arrays(7, m.hidden_size, seed=1), m, commits=3)
    order = [5, 0, 6, 2, 1, 4, 3] * 2
    # recycle: each sample's buffers go back to the pool once checked, so later reads reuse them.
    with SampleReader(store.dataset(str(tmp_path), store.FEATURES), threads=3, recycle=True) as reader:
        for s, i in zip(reader.iter_samples(order), order, strict=True):  # a short read fails
            assert s.index == i and s.input_ids.tolist() == rows[i]["input_ids"]
            assert s.aux_stored().dtype == torch.bfloat16
            assert s.aux_stored().contiguous().view(torch.uint8).numpy().tobytes() == rows[i]["aux_hidden"]
            assert s.last_stored().contiguous().view(torch.uint8).numpy().tobytes() == rows[i]["last_hidden"]
            s.release()
        assert 0 < len(reader.pool._free) <= 2 * (reader.threads + 1)


def _version1_table(uri, samples, m):
    """A table as eaglenest wrote it before schema version 2: plain large_binary tensor columns."""
    import lance

    fields = [pa.field(f.name, f.type, nullable=f.nullable) for f in S.FEATURES_SCHEMA]
    md = {**S.features_schema(m).metadata, b"eaglenest.schema_version": b"1"}
    schema = pa.schema(fields, metadata=md)
    lance.write_dataset(pa.Table.from_pylist(_rows(samples, m), schema=schema),
                        str(store.table_path(uri, store.FEATURES)), schema=schema, data_storage_version="2.0")


def test_version1_tables_read_through_take_and_refuse_appends(tmp_path):
    m = _meta("bfloat16")
    uri = str(tmp_path)
    samples = _arrays(5, m.hidden_size, seed=2)
    _version1_table(uri, samples, m)
    ds = store.dataset(uri, store.FEATURES)
    assert S.schema_version(ds.schema) == 1 and S.tensor_layout(ds.schema) == "inline"
    ref = _reference(uri, m, pack_tokens=64)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=64, batch_rows=2, seed=0)
    for rows in shards.plan(0):
        _assert_batches_equal(shards.read(rows), collate([[ref[i] for i in row] for row in rows]))
    _assert_pipelined_reads_equal(shards, ref)
    shards.reader.close()
    more = pa.Table.from_pylist(_rows(_arrays(1, m.hidden_size, seed=9), m), schema=S.features_schema(m))
    with pytest.raises(SchemaError, match="schema version 1 .*writes version 2"):
        store.append(uri, store.FEATURES, more, meta=m)


def test_unreadable_schema_version_is_a_clear_error(tmp_path):
    import lance

    m = _meta("float32")
    schema = S.features_schema(m).with_metadata({**S.features_schema(m).metadata, b"eaglenest.schema_version": b"9"})
    lance.write_dataset(schema.empty_table(), str(store.table_path(str(tmp_path), store.FEATURES)), schema=schema)
    with pytest.raises(SchemaError, match="schema version 9, this eaglenest reads 1, 2"):
        store.dataset(str(tmp_path), store.FEATURES)


def test_fp8_round_trip_error_and_bytes_per_token(tmp_path):
    hidden = 256
    samples = _arrays(6, hidden, seed=4)
    # Round trip: per element within e4m3's half spacing (3 mantissa bits: 2^-4 relative, and 2^-10
    # of the row scale in the subnormal range), per token row within 2^-4 in L2.
    for _, _, aux, last in samples:
        for x in (aux, last):
            y = S.decode_fp8(S.encode_fp8(x, "float32"), x.shape).numpy()
            scale = np.abs(x).max(-1, keepdims=True) / S.FP8_MAX
            assert (np.abs(y - x) <= 2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scale + 1e-6 * np.abs(x)).all()
            rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
            assert rel.max() <= 2.0 ** -4 and rel.mean() > 1e-3  # lossy, and not by accident exact
    # Bytes on disk per token: fp8 about half of bf16 (e4m3 codes + one fp32 scale per row).
    sizes = {}
    for dtype, storage in (("bfloat16", "raw"), ("float32", "fp8_e4m3")):
        uri = str(tmp_path / storage)
        _write(uri, samples, _meta(dtype, hidden, storage), commits=1)
        assert maintenance.verify(uri, store.FEATURES)["ok"]
        sizes[storage] = sum(p.stat().st_size for p in (store.table_path(uri, store.FEATURES) / "data").iterdir())
    assert 0.48 < sizes["fp8_e4m3"] / sizes["raw"] < 0.55


def test_fp8_nonfinite_is_found_by_verify(tmp_path):
    m = _meta("float32", storage="fp8_e4m3")
    rows = _rows(_arrays(3, m.hidden_size, seed=5), m)
    aux = np.ones((rows[1]["num_tokens"], 3, m.hidden_size), "f4")
    aux[0, 1, 2] = np.inf
    rows[1]["aux_hidden"] = S.encode_fp8(aux, "float32")
    store.append(str(tmp_path), store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = maintenance.verify(str(tmp_path), store.FEATURES)
    assert not report["ok"] and "NaN/inf in aux_hidden" in report["problems"][0] and "s01" in report["problems"][0]


# --- the read path at disk speed: straight into the batch, the adaptive window, bounded memory ---

def _profiled_shards(uri, *, pack_tokens, batch_dtype, read_threads=None, direct=True):
    from eaglenest.featurestore.read.profile import ReadProfile

    prof = ReadProfile()
    return FeatureShards(uri, version=None, split="train", pack_tokens=pack_tokens, batch_rows=2, seed=3,
                         read_threads=read_threads, batch_dtype=batch_dtype, profile=prof, direct=direct), prof


@pytest.mark.parametrize("dtype,layers,direct", [("bfloat16", LAYERS, False), ("bfloat16", (2, 4, 5), False),
                                                 ("float16", LAYERS, False), ("float32", LAYERS, False),
                                                 ("bfloat16", LAYERS, True), ("bfloat16", (2, 4, 5), True)])
def test_stored_dtype_batch_is_bit_exact_and_read_straight_into_it(tmp_path, dtype, layers, direct):
    """batch_dtype="stored", truncated to pack_tokens, bit for bit. Through the page cache
    (direct=False) the values land in the batch by pread (aux layers reordered by a scatter preadv
    when the table's layer ids are not ascending); with O_DIRECT (where the file system has it)
    the disk fills a pooled buffer and one copy (a gather for the reorder) places it."""
    m = S.FeatureMeta(target="t", layer_ids=layers, last_layer_id=8, hidden_size=16, dtype=dtype, storage="raw",
                      feature_set_id=f"fs-{dtype}-{layers}")
    uri = str(tmp_path)
    _write(uri, _arrays(9, m.hidden_size, seed=6), m)
    want_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    order = np.argsort(np.asarray(layers), kind="stable")
    ref = []
    for r in store.read(uri, store.FEATURES).to_pylist():
        T, n = r["num_tokens"], min(r["num_tokens"], 10)
        aux = S.torch_from_blob(r["aux_hidden"], (T, 3, m.hidden_size), dtype)
        last = S.torch_from_blob(r["last_hidden"], (T, m.hidden_size), dtype)
        ref.append((torch.tensor(r["input_ids"][:n]), torch.tensor(r["loss_mask"][:n]).bool(),
                    aux[:n, order].reshape(n, -1), last[:n]))
    shards, prof = _profiled_shards(uri, pack_tokens=10, batch_dtype="stored", direct=direct)
    o_direct = any(fd is not None for fd in shards.reader._dfds.values())  # this file system has it
    try:
        assert shards.batch_dtype == want_dtype
        for rows in shards.plan(0):
            got = shards.read(rows)
            assert got.aux.dtype == want_dtype and got.last_hidden.dtype == want_dtype
            _assert_batches_equal(got, collate([[ref[i] for i in row] for row in rows]))
    finally:
        shards.close()
    if o_direct:  # the disk (or the page cache, while warm) fills a pooled buffer, one copy places it
        assert prof.calls["convert into destination"] == 9 and "pread into destination" not in prof.calls
        return
    into = "pread into destination" if list(order) == [0, 1, 2] else "preadv scatter into destination"
    assert prof.calls[into] > 0 and "convert into destination" not in prof.calls
    assert not any(k.startswith("pread into fresh") or k.startswith("pread into mapped") for k in prof.calls)


def test_fp8_and_float32_batches_convert_on_the_reader_threads(tmp_path):
    """An fp8 table gives a float32 batch whatever batch_dtype asks (dequantised into it), and a bf16
    table read into float32 goes through a pooled buffer and one converting copy."""
    for dtype, storage, batch_dtype in (("float32", "fp8_e4m3", "stored"), ("bfloat16", "raw", "float32")):
        m = _meta(dtype, storage=storage)
        uri = str(tmp_path / f"{storage}-{batch_dtype}")
        _write(uri, _arrays(7, m.hidden_size, seed=8), m)
        ref = _reference(uri, m, pack_tokens=10)
        shards, prof = _profiled_shards(uri, pack_tokens=10, batch_dtype=batch_dtype)
        try:
            assert shards.batch_dtype == torch.float32
            for rows in shards.plan(0):
                _assert_batches_equal(shards.read(rows), collate([[ref[i] for i in row] for row in rows]))
        finally:
            shards.close()
        assert prof.calls["convert into destination"] == 7 and "pread into destination" not in prof.calls


def test_scatter_read_past_iov_max_and_short_destination(tmp_path):
    """A sample of 700 tokens with reordered layers needs 1400 iovecs (more than one preadv call)."""
    from eaglenest.featurestore.read.pread import IOV_MAX
    from eaglenest.featurestore.read.sample import Into

    m = _meta("bfloat16", hidden=8)
    rng = np.random.default_rng(3)
    T = 700
    aux = rng.standard_normal((T, 3, 8)).astype("f4")
    last = rng.standard_normal((T, 8)).astype("f4")
    _write(str(tmp_path), [("long", rng.integers(0, 50, T).astype("i4"), aux, last)], m, commits=1)
    order = [1, 2, 0]
    assert 2 * T > IOV_MAX
    want_aux = torch.from_numpy(aux).bfloat16()[:, order]
    for n in (T, 333):
        out_aux, out_last = torch.empty(n, 3, 8, dtype=torch.bfloat16), torch.empty(n, 8, dtype=torch.bfloat16)
        with SampleReader(store.dataset(str(tmp_path), store.FEATURES), integrity="off", direct=False) as reader:
            (s,) = reader.read([0], into=[Into(aux=out_aux, last=out_last, order=order)])
        assert s.num_tokens == T and torch.equal(out_aux, want_aux[:n])
        assert torch.equal(out_last, torch.from_numpy(last).bfloat16()[:n])
        with pytest.raises(SchemaError, match="read into a destination"):
            s.aux_stored()


def test_adaptive_window_climbs_while_it_pays_and_stays_in_bounds():
    from eaglenest.featurestore.read.window import AdaptiveWindow

    def drive(w, rate_of, periods=60, nbytes=1 << 20):
        now, sizes = 0.0, []
        for _ in range(periods * 40):
            size = w.current()
            sizes.append(size)
            now += nbytes / rate_of(size)
            w.record(nbytes, now=now)
        return sizes

    # Throughput grows up to 5 in flight, then flat: the window reaches 5 and stays near it.
    w = AdaptiveWindow(start=2, lo=1, hi=12, budget=1 << 40)
    sizes = drive(w, lambda k: min(k, 5) * 1e8)
    assert max(sizes) <= 12 and min(sizes) >= 1
    assert {5} <= set(sizes[len(sizes) // 2:]) <= {4, 5, 6}
    # Flat from the start (a saturated disk): the window settles at 1-2, never climbs far.
    w = AdaptiveWindow(start=2, lo=1, hi=12, budget=1 << 40)
    assert set(drive(w, lambda k: 1e8)[len(sizes) // 4:]) <= {1, 2, 3}
    # Always better with more (an object store's latency): capped by the memory budget, then hi.
    w = AdaptiveWindow(start=2, lo=1, hi=12, budget=7 << 20)
    sizes = drive(w, lambda k: k * 1e8)
    assert max(sizes) == 7 and sizes[-1] == 7
    w = AdaptiveWindow(start=2, lo=1, hi=12, budget=1 << 40)
    assert max(drive(w, lambda k: k * 1e8)) == 12
    # A floor of 2 (the reader's): flat or noisy rates never take it to 1; the memory budget still
    # does, when one sample is all it allows.
    w = AdaptiveWindow(start=2, lo=2, hi=12, budget=1 << 40)
    noisy = random.Random(5)
    sizes = drive(w, lambda k: 1e8 * noisy.uniform(0.5, 1.5))
    assert min(sizes) == 2 and max(sizes) > 2
    w = AdaptiveWindow(start=2, lo=2, hi=12, budget=(3 << 20) // 2)
    assert set(drive(w, lambda k: k * 1e8, periods=5)[1:]) == {1}
    # Fixed: never moves.
    w = AdaptiveWindow(start=3, lo=3, hi=3, fixed=True)
    assert set(drive(w, lambda k: k * 1e8, periods=5)) == {3}


def test_reader_in_flight_and_memory_bounded_by_the_budget_not_the_table(tmp_path):
    """Samples in flight never exceed what the memory budget allows, and the buffers the reader
    allocates (its memory) stay within the bound whether the table has 6 or 30 samples."""
    m = _meta("bfloat16", hidden=512)
    peak = {}
    for n in (6, 30):
        uri = str(tmp_path / str(n))
        _write(uri, _arrays(n, m.hidden_size, seed=n), m, commits=3)
        ds = store.dataset(uri, store.FEATURES)
        biggest = max(r["num_tokens"] for r in store.read(uri, store.FEATURES).to_pylist()) * 4 * 512 * 2
        budget = 3 * biggest
        with SampleReader(ds, recycle=True, memory_budget=budget, integrity="off") as reader:
            running, most, lock = [0], [0], threading.Lock()
            inner = reader._from_row

            def counted(*a, **kw):  # observes the product's own calls; reads as usual
                with lock:
                    running[0] += 1
                    most[0] = max(most[0], running[0])
                try:
                    return inner(*a, **kw)
                finally:
                    with lock:
                        running[0] -= 1

            reader._from_row = counted
            for epoch in range(3):
                order = np.random.default_rng(epoch).permutation(n).tolist()
                for s in reader.iter_samples(order):
                    s.release()
            assert most[0] <= reader.window.limit() <= 3
            history = reader.window.history  # 18 or 90 deliveries: periods of 4-6 of them were measured
            assert history and all(2 <= w <= 3 for w, _ in history), history  # the reader's floor is 2
            assert reader.pool.free_bytes <= budget
            # idle (<= budget) + in flight + the one the consumer holds, 2 values each, each
            # buffer at most twice its value (the pool's rounding)
            bound = budget + (reader.window.limit() + 1) * 2 * 2 * biggest
            assert 0 < reader.pool.peak_live <= bound
            peak[n] = reader.pool.peak_live
    assert peak[30] <= bound  # five times the table, the same bound


def test_batch_memory_is_reused_only_when_no_tensor_holds_it(tmp_path):
    """Batches come from reused arenas (their pages mapped once); a batch the caller still holds,
    or a view of it, is never overwritten by a later read."""
    m = _meta("bfloat16")
    uri = str(tmp_path)
    _write(uri, _arrays(9, m.hidden_size, seed=11), m)
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=10, batch_rows=1, seed=3,
                           batch_dtype="stored")
    try:
        plan = shards.plan(0)
        assert len(plan) >= 4
        held = shards.read(plan[0])
        kept = held.aux[:, 1:].clone(), held.last_hidden.clone()
        view = held.aux[:, 1:]  # a view alone keeps the memory
        last = held.last_hidden
        del held
        for _ in range(2):
            for rows in plan[1:]:
                shards.read(rows)  # dropped at once: their arenas are reused
        assert torch.equal(view, kept[0]) and torch.equal(last, kept[1])
        assert shards._arenas.allocated <= 3
    finally:
        shards.close()


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process' mapping holding ``address`` (/proc/self/smaps)."""
    inside, flags = False, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                flags = set(line.split()[1:])
    assert flags is not None, "no mapping holds the address"
    return flags


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="the kernel has no transparent huge pages to advise")
def test_large_read_buffers_and_batch_arenas_ask_for_huge_pages_and_are_reused_safely():
    """Buffers of 2 MiB up (the pool's, the batch arenas) are their own 2 MiB-aligned mappings
    advised MADV_HUGEPAGE (cold reads into 4 KiB pages fell to a third of the speed); smaller ones
    stay 4 KiB-aligned heap memory. An arena of such a mapping is still handed out again only when
    no tensor made from it is alive."""
    from eaglenest.featurestore.read.pread import ALIGN, HUGE, aligned
    from eaglenest.train.data import BatchArenas

    small, big = aligned(3 * ALIGN), aligned(3 * HUGE + 5)
    assert small.ctypes.data % ALIGN == 0 and big.ctypes.data % HUGE == 0 and big.size == 3 * HUGE + 5
    assert "hg" in _vm_flags(big.ctypes.data) and "hg" not in _vm_flags(small.ctypes.data)
    arenas = BatchArenas(keep=2)
    shape = (2, HUGE // 4)  # 4 MiB of float32
    a, = arenas.tensors([shape], torch.float32)
    assert "hg" in _vm_flags(a.data_ptr())
    a.fill_(1.0)
    view = a[1]
    del a
    b, = arenas.tensors([shape], torch.float32)  # the view keeps the first arena: a second one
    b.fill_(2.0)
    assert arenas.allocated == 2 and bool((view == 1.0).all())
    del view, b
    arenas.tensors([shape], torch.float32)
    assert arenas.allocated == 2  # both idle now: one is reused
