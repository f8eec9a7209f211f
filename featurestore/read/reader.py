"""Fast per-sample reads of a features table: values ``pread`` straight into their tensors.

What a training read needs is whole samples (~50 MB of hidden states each at H=4096) in a shuffled
order. Lance's own ``take`` of a ``large_binary`` value reads it in ~13 MiB pieces into temporary
buffers, then copies them into the output array: two buffers of fresh pages (page faults cost as
much as the disk on this VM) and a copy per value; one take at a time also leaves the disk idle
during the copy. Measured (``bench/featurestore_read.py``, cold page cache) that path stayed at
0.2-0.5 of a raw sequential read of the same bytes, with or without threads, in file formats 2.0,
2.1 and 2.2, and Lance's blob readers (``take_blobs``/``read_blobs``) do the same copy.

So the tensor columns are Lance **blob columns** (schema version 2, ``schema.BLOB_METADATA``): a
value's bytes lie contiguously in the fragment's data file and ``take`` returns its
``(position, size)``. :class:`SampleReader` takes the small columns and those descriptors (one
``take`` per group of samples), then ``os.preadv``-s each value into one buffer that the tensors
view: one read, no copy, the memory of the value and nothing else. With ``recycle=True`` buffers
come from a :class:`BufferPool` and go back on :meth:`Sample.release`, so their pages are already
mapped. Given destinations (``iter_samples(..., into=...)``: the trainer's batch tensors), a value
stored in the destination's dtype is read **straight into the destination**, truncated to the
tokens it needs, the aux layers put in the wanted order by the same ``preadv`` (one iovec per run
of layers that stay in order): no buffer, no copy. Otherwise (another dtype, fp8, an object store,
a version-1 table) the value is read into a pooled buffer and converted into the destination on the
reader's thread, so conversions of different samples run in parallel.

``direct=True`` reads pooled buffers with ``O_DIRECT`` (the disk writes into the buffer, no
page-cache copy; the page cache is tried first with ``RWF_NOWAIT`` so warm epochs stay warm), and
destinations are then filled by one copy from such a buffer. Off by default: side by side, cold,
under load, the trainer's read with it was 0.39x and 1.27x as fast in two runs (inconclusive;
BENCHMARKS.md), and plain ``pread`` keeps the page cache for warm epochs.

Samples in flight: chosen by the reader (:class:`AdaptiveWindow`) from the delivery rate it
measures, the same for local files and object stores: it grows the window while the rate improves
by more than 5% and turns back when it does not, between 1 and ``max_in_flight``, and never beyond
``memory_budget`` bytes of samples in flight (the largest sample seen sets the bound). ``threads=N``
fixes the window at N instead (the bench's arms). ``readahead=True`` also asks the kernel to read a
group's values ahead (``POSIX_FADV_WILLNEED``) once its descriptors are known; off by default (two
``pread`` threads alone were faster cold on a quiet machine; see BENCHMARKS.md).
When a data file is not a local file (object storage), Lance's ``BlobFile.readinto`` fills the
same buffer instead. Version-1 tables (inline ``large_binary``) are read with ``take``, zero-copy
views of Lance's output (slower, as above).

Where the time goes: give the reader a :class:`ReadProfile` and every step (the take, descriptor
lookup, buffer, ``pread`` into mapped / fresh / destination pages, iovec building, tensor views,
conversion, the consumer's wait) adds its seconds and bytes there; ``bench/featurestore_read.py
--profile`` prints it. Without one, a section costs one attribute test.

Trade-off: the reader relies on Lance's blob descriptor being a byte range of the data file that
the manifest lists for the fragment (true for Lance blob v1 columns in file format 2.0; checked
against the tensor shape on decode, and ``featurestore verify`` checks every data file's CRC).
Integrity: before the first read, every data file of the version is held to its CRC sidecar
(:func:`eaglenest.featurestore.table.integrity.check_version`: one ``stat`` per file once the file's
stamp is recorded, a full CRC pass otherwise), since a ``pread`` returns whatever bytes the file
holds. A short read or a Lance error while taking a fragment's rows is a :class:`StoreError`
naming the fragment and file. ``integrity="off"`` skips the check (the read bench's baseline).
Memory: the samples in flight (at most ``memory_budget`` bytes), the pool's idle buffers (at most
``memory_budget`` bytes), and what the caller holds; the table's size does not enter.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table.integrity import VERIFY_HINT, check_version, read_error

COLUMNS = ["input_ids", "loss_mask", "aux_hidden", "last_hidden"]
#: Default bound on the bytes of samples in flight (and on the pool's idle buffers).
MEMORY_BUDGET = 512 << 20
#: Iovecs per ``preadv`` call (Linux's IOV_MAX).
IOV_MAX = 1024
#: Alignment of ``O_DIRECT`` reads (buffer address, file offset, length).
ALIGN = 4096


def _torch():
    import torch

    return torch


def _view(buf, np_dtype=np.uint8):
    """A torch tensor viewing ``buf`` (read-only Arrow memory; never written through)."""
    torch = _torch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the views are read only
        return torch.from_numpy(np.frombuffer(buf, np_dtype))


def _binary_value(col: pa.ChunkedArray):
    """The single value of a one-row ``large_binary`` column as a zero-copy Arrow buffer slice."""
    chunk = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    _, offsets, data = chunk.buffers()
    offs = np.frombuffer(offsets, np.int64)[chunk.offset:chunk.offset + 2]
    return data.slice(int(offs[0]), int(offs[1] - offs[0]))


def _list_values(col: pa.ChunkedArray) -> np.ndarray:
    chunk = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return chunk.flatten().to_numpy(zero_copy_only=True)


class _Section:
    __slots__ = ("prof", "name", "nbytes", "t0")

    def __init__(self, prof, name, nbytes):
        self.prof, self.name, self.nbytes = prof, name, nbytes

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.prof.add(self.name, time.perf_counter() - self.t0, self.nbytes)


class _NoSection:
    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


_OFF = _NoSection()


class ReadProfile:
    """Where a read's time goes: seconds, calls and bytes per named section, summed over the
    reader's threads (so shares of the wall time can add up to more than 100%)."""

    def __init__(self):
        self.secs: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.nbytes: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, name: str, secs: float, nbytes: int = 0) -> None:
        with self._lock:
            self.secs[name] += secs
            self.calls[name] += 1
            self.nbytes[name] += nbytes

    def section(self, name: str, nbytes: int = 0) -> _Section:
        return _Section(self, name, nbytes)

    def lines(self, *, samples: int, wall_s: float) -> list[str]:
        """One line per section: total seconds, ms per sample, share of ``wall_s``, calls, mean
        bytes per call and GB/s where it moved bytes."""
        out = []
        for name, secs in sorted(self.secs.items(), key=lambda kv: -kv[1]):
            calls, nb = self.calls[name], self.nbytes[name]
            extra = f", {nb / calls / 2**20:6.1f} MiB/call, {nb / secs / 1e9:5.2f} GB/s" if nb and secs else ""
            out.append(f"{name:<34} {secs:7.3f} s {1e3 * secs / max(samples, 1):8.2f} ms/sample "
                       f"{100 * secs / wall_s if wall_s else 0:6.1f} % of wall  {calls:6d} calls{extra}")
        return out


def _section(prof: ReadProfile | None, name: str, nbytes: int = 0):
    return _OFF if prof is None else prof.section(name, nbytes)


class AdaptiveWindow:
    """How many samples a reader keeps in flight, chosen from the delivery rate it measures.

    Every period (``max(min_period, 2 * size)`` deliveries) the rate in bytes per second is
    compared with the rate last measured at the size the window came from: better by more than
    ``tolerance``, the window keeps moving the same way; otherwise it turns back. So it climbs
    while more parallel reads pay (a latency-bound object store, a disk with queue depth) and
    settles low where they do not (a CPU-bound or saturated disk), within ``[lo, hi]`` and within
    ``budget`` bytes of samples in flight (the largest sample seen). ``fixed=True``: never moves.
    """

    def __init__(self, *, start: int = 2, lo: int = 1, hi: int = 16, budget: int = MEMORY_BUDGET,
                 fixed: bool = False, min_period: int = 4, tolerance: float = 0.05):
        if not 1 <= lo <= hi:
            raise ValueError("the window needs 1 <= lo <= hi")
        self.lo, self.hi, self.budget, self.fixed = lo, hi, budget, fixed
        self.size = min(max(start, lo), hi)
        self.min_period, self.tolerance = min_period, tolerance
        self.sample_bytes = 0
        #: (window size, bytes/s) per finished period: how the size was chosen.
        self.history: list[tuple[int, float]] = []
        self._rates: dict[int, float] = {}
        self._dir = 1
        self._t0: float | None = None
        self._bytes = 0
        self._n = 0

    def limit(self) -> int:
        """The largest window the memory budget allows, given the largest sample seen."""
        if self.fixed:
            return self.size
        by_memory = self.budget // self.sample_bytes if self.sample_bytes else self.hi
        return max(self.lo, min(self.hi, int(by_memory)))

    def current(self) -> int:
        return self.size if self.fixed else min(self.size, self.limit())

    def record(self, nbytes: int, now: float | None = None) -> None:
        """One sample of ``nbytes`` delivered to the consumer."""
        now = time.perf_counter() if now is None else now
        self.sample_bytes = max(self.sample_bytes, int(nbytes))
        if self._t0 is None:  # the first delivery starts the clock
            self._t0 = now
            return
        self._bytes += int(nbytes)
        self._n += 1
        if self._n < max(self.min_period, 2 * self.current()) or now <= self._t0:
            return
        rate = self._bytes / (now - self._t0)
        self._t0, self._bytes, self._n = now, 0, 0
        self._step(rate)

    def _step(self, rate: float) -> None:
        w = self.current()
        self.history.append((w, rate))
        if self.fixed:
            return
        self._rates[w] = rate
        came_from = self._rates.get(w - self._dir)
        if came_from is not None and rate < came_from * (1 + self.tolerance):
            self._dir = -self._dir  # no clear gain from the last move: go back
        nxt = w + self._dir
        if not self.lo <= nxt <= self.limit():  # at a bound and still gaining: stay there
            nxt = w
        self.size = min(max(nxt, self.lo), self.limit())


@dataclasses.dataclass
class Into:
    """Where a sample's tensors go: ``aux`` ``[n, n_aux, H]`` and ``last`` ``[n, H]`` (contiguous,
    any float dtype, ``n`` <= the sample's tokens), aux layers taken in ``order`` (table layer
    positions; None = table order)."""

    aux: object
    last: object
    order: Sequence[int] | None = None


@dataclasses.dataclass
class Sample:
    """One row of a features table, its tensors viewing the Arrow buffers it keeps alive."""

    index: int                 # dataset offset (``take`` index)
    meta: S.FeatureMeta
    input_ids: np.ndarray      # int32 [T], view
    loss_mask: np.ndarray      # uint8 [T], view
    _aux: object               # buffer of the aux value (Arrow buffer or numpy bytes); None: read into a destination
    _last: object              # buffer of the last value
    _table: pa.Table           # owner of the small columns' buffers
    _pool: "BufferPool | None" = None
    _owned: tuple = ()         # pooled buffers to hand back on release()

    def release(self) -> None:
        """Hand this sample's buffers back to the reader's pool (``recycle=True``): its tensors
        must not be used afterwards. Without a pool this only drops the references."""
        if self._pool is not None:
            for b in self._owned:
                self._pool.put(b)
        self._owned, self._pool, self._aux, self._last = (), None, None, None

    def ids_tensor(self):
        """``input_ids`` as an int32 torch tensor viewing the Arrow buffer."""
        return _view(self.input_ids, np.int32)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_aux(self) -> int:
        return len(self.meta.layer_ids)

    def _stored(self, buf, shape: tuple[int, ...]):
        """raw: a view of the stored dtype; fp8: (scales [rows] fp32, codes [rows, H] e4m3) views."""
        torch = _torch()
        m = self.meta
        if buf is None:
            raise SchemaError(f"row {self.index} was read into a destination; its values are not held")
        if m.storage == "raw":
            t = _view(buf).view(stored_torch_dtype(m))
            if t.numel() != int(np.prod(shape)):
                raise SchemaError(f"tensor of {t.numel()} elements cannot be shaped {shape}")
            return t.view(shape)
        if m.storage == "fp8_e4m3":
            rows = int(np.prod(shape[:-1]))
            scales, codes = S.fp8_parts(buf, rows, shape[-1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return (torch.from_numpy(scales).view(*shape[:-1]),
                        torch.from_numpy(codes).view(torch.float8_e4m3fn).view(shape))
        raise SchemaError(f"unknown storage mode {m.storage!r}")

    def aux_stored(self):
        """raw: ``[T, n_aux, H]`` view in the stored dtype (table layer order)."""
        return self._stored(self._aux, (self.num_tokens, self.num_aux, self.meta.hidden_size))

    def last_stored(self):
        return self._stored(self._last, (self.num_tokens, self.meta.hidden_size))

    def aux_into(self, out, *, order=None):
        """Write the first ``n = out.shape[0]`` tokens' aux states into ``out`` (``[n, n_aux, H]``,
        float), layers taken in ``order`` (a list of table layer positions; None = table order).
        One converting copy per layer at most; fp8 is dequantised in place."""
        n = out.shape[0]
        src = self.aux_stored()
        idx = list(range(self.num_aux)) if order is None else [int(j) for j in order]
        if self.meta.storage == "raw":
            if idx == list(range(self.num_aux)):
                out.copy_(src[:n])
            elif out.dtype == src.dtype and out.is_contiguous():  # one gather, no per-layer passes
                _torch().index_select(src[:n], 1, _torch().as_tensor(idx), out=out)
            else:
                for k, j in enumerate(idx):
                    out[:, k].copy_(src[:n, j])
            return out
        scales, codes = src
        for k, j in enumerate(idx):
            out[:, k].copy_(codes[:n, j]).mul_(scales[:n, j, None])
        return out

    def last_into(self, out):
        """Write the first ``out.shape[0]`` tokens' last hidden states into ``out`` (``[n, H]``)."""
        n = out.shape[0]
        src = self.last_stored()
        if self.meta.storage == "raw":
            return out.copy_(src[:n])
        scales, codes = src
        return out.copy_(codes[:n]).mul_(scales[:n, None])


def stored_torch_dtype(meta: S.FeatureMeta):
    """The torch dtype of a raw-storage table's values."""
    torch = _torch()
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[meta.dtype]


class BufferPool:
    """Reusable byte buffers: a recycled buffer's pages are already mapped, so the next value read
    into it costs no page faults (on this VM faulting fresh pages costs about as much as the disk
    read itself: ``bench/featurestore_read.py``'s ``disk`` vs ``raw``). Buffers grow in 8 MiB steps
    (small ones to the next power of two); the pool keeps at most ``max_bytes`` of idle ones (the
    smallest are dropped first, one is always kept)."""

    STEP = 8 << 20

    def __init__(self, max_bytes: int = MEMORY_BUDGET):
        self.max_bytes = max_bytes
        #: Bytes of the buffers this pool allocated and dropped; ``peak_live``: the most allocated
        #: and not dropped at once (idle, in flight or held by the caller): the reader's memory.
        self.allocated = self.dropped = self.peak_live = 0
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return sum(b.size for b in self._free)

    @classmethod
    def rounded(cls, nbytes: int) -> int:
        nbytes = max(int(nbytes), 1)
        if nbytes >= cls.STEP:
            return -(-nbytes // cls.STEP) * cls.STEP
        return max(4096, 1 << (nbytes - 1).bit_length())

    def get(self, nbytes: int) -> tuple[np.ndarray, bool]:
        """(a buffer of at least ``nbytes``, whether it was reused: its pages already mapped)."""
        with self._lock:
            fits = [k for k, b in enumerate(self._free) if b.size >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda k: self._free[k].size)), True
            size = self.rounded(nbytes)
            self.allocated += size
            self.peak_live = max(self.peak_live, self.allocated - self.dropped)
        return _aligned(size), False

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > 1 and sum(b.size for b in self._free) > self.max_bytes:
                # drop the smallest (arrays compare elementwise: by index)
                k = min(range(len(self._free)), key=lambda k: self._free[k].size)
                self.dropped += self._free.pop(k).size


def _aligned(size: int) -> np.ndarray:
    """``size`` bytes starting on an :data:`ALIGN` boundary (what ``O_DIRECT`` reads need)."""
    raw = np.empty(size + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + size]


def _read_error(exc: OSError, where: str) -> StoreError:
    return StoreError(f"{where}: read failed ({exc}); {VERIFY_HINT}")


def _pread_into(fd: int, buf, position: int, *, where: str = "a data file") -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.preadv(fd, [mv[done:]], position + done)
        except OSError as exc:  # EIO from the disk: name the file, no traceback
            raise _read_error(exc, where) from None
        if n <= 0:
            raise StoreError(f"{where} ended {len(mv) - done} bytes short of a blob value at byte "
                             f"{position} (truncated?); {VERIFY_HINT}")
        done += n


def _pread_direct(fd: int, buf: np.ndarray, start: int, need: int, *, where: str) -> None:
    """``O_DIRECT`` read of the aligned file range from ``start`` (aligned) into ``buf`` (aligned,
    its size a multiple of :data:`ALIGN`) until at least ``need`` bytes are in (the file may end
    within the last block). EINVAL (alignment the file system refuses) propagates."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < need:
        try:
            n = os.preadv(fd, [mv[done:]], start + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise
            raise _read_error(exc, where) from None
        if n <= 0:
            raise StoreError(f"{where} ended {need - done} bytes short of a blob value at byte "
                             f"{start + done} (truncated?); {VERIFY_HINT}")
        done += n


def _open_direct(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) if hasattr(os, "O_DIRECT") else None
    except OSError:  # tmpfs and some network file systems refuse O_DIRECT
        return None


def _pread_nowait(fd: int, buf: np.ndarray, position: int) -> bool:
    """Read all of ``buf`` from the page cache only (``RWF_NOWAIT``); False if any of it is not
    cached (nothing is waited for; the caller reads it from the disk)."""
    try:
        n = os.preadv(fd, [memoryview(buf).cast("B")], position, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: an old kernel
        return False
    return n == buf.size


def _preadv_all(fd: int, bufs: list[memoryview], position: int, *, where: str) -> None:
    """Fill ``bufs`` in turn from the file range starting at ``position`` (scatter read), at most
    :data:`IOV_MAX` iovecs per call, resuming after short reads."""
    i, pos = 0, position
    bufs = list(bufs)
    while i < len(bufs):
        try:
            n = os.preadv(fd, bufs[i:i + IOV_MAX], pos)
        except OSError as exc:
            raise _read_error(exc, where) from None
        if n <= 0:
            raise StoreError(f"{where} ended {sum(len(b) for b in bufs[i:])} bytes short of a blob value "
                             f"at byte {position} (truncated?); {VERIFY_HINT}")
        pos += n
        while n and i < len(bufs):
            if n >= len(bufs[i]):
                n -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][n:]
                n = 0


def _scatter_runs(order: Sequence[int], n_aux: int, row: int) -> list[tuple[int, int]]:
    """For one token: (destination byte offset, length) of each run of stored layers, in file
    order, that lands contiguously in the destination (layer ``k`` of the destination is stored
    layer ``order[k]``; ``row`` bytes per layer)."""
    inv = [0] * n_aux
    for k, j in enumerate(order):
        inv[j] = k
    runs: list[list[int]] = []
    for j in range(n_aux):
        off = inv[j] * row
        if runs and runs[-1][0] + runs[-1][1] == off:
            runs[-1][1] += row
        else:
            runs.append([off, row])
    return [(a, b) for a, b in runs]


@dataclasses.dataclass
class _Group:
    """One ``take`` of a group of samples: small columns and blob descriptors as numpy arrays."""

    table: pa.Table
    frags: np.ndarray
    pos: dict
    size: dict
    ids: np.ndarray
    ids_off: np.ndarray
    mask: np.ndarray
    mask_off: np.ndarray

    @classmethod
    def of(cls, t: pa.Table) -> "_Group":
        def lists(name):
            c = t.column(name).combine_chunks()
            offs = c.offsets.to_numpy()
            return c.values.to_numpy(zero_copy_only=True), offs

        def desc(name):
            c = t.column(name).combine_chunks()
            return (c.field("position").to_numpy(zero_copy_only=False).astype(np.int64),
                    c.field("size").to_numpy(zero_copy_only=False).astype(np.int64))

        pos, size = {}, {}
        for col in S.TENSOR_COLUMNS:
            pos[col], size[col] = desc(col)
        ids, ids_off = lists("input_ids")
        mask, mask_off = lists("loss_mask")
        return cls(table=t, frags=t.column("_rowaddr").to_numpy().astype(np.uint64) >> np.uint64(32),
                   pos=pos, size=size, ids=ids, ids_off=ids_off, mask=mask, mask_off=mask_off)


class SampleReader:
    """Reads samples of one pinned table version, several in flight (see the module docstring).

    ``threads``: None (default) lets :class:`AdaptiveWindow` choose the samples in flight between
    1 and ``max_in_flight`` within ``memory_budget``; an int fixes it. ``profile``: a
    :class:`ReadProfile` to time each step in. One consumer per iterator; :meth:`close` (or
    ``with``) stops the pool and closes files.
    """

    def __init__(self, ds, *, threads: int | None = None, recycle: bool = False,
                 memory_budget: int = MEMORY_BUDGET, max_in_flight: int = 16, readahead: bool = False,
                 integrity: Literal["check", "off"] = "check", profile: ReadProfile | None = None,
                 direct: bool = False):
        if threads is not None and threads < 1:
            raise ValueError("threads must be >= 1")
        if integrity not in ("check", "off"):
            raise ValueError(f"integrity must be 'check' or 'off', not {integrity!r}")
        self.ds = ds
        if integrity == "check":  # before any read: every data file of this version against its CRC
            check_version(ds)
        #: With ``recycle``, blob values are read into pooled buffers that :meth:`Sample.release`
        #: hands back (version-2 tables; Lance's ``take`` allocates its own on version 1). Values
        #: converted into a destination always go through the pool.
        self.pool = BufferPool(memory_budget) if recycle else None
        self._scratch = self.pool or BufferPool(memory_budget)
        #: Kernel readahead of each group's values once its descriptors are known (see _willneed).
        self.readahead = readahead
        self.profile = profile
        self.meta = S.feature_meta(ds.schema)
        self.layout = S.tensor_layout(ds.schema)
        #: Samples in flight: adaptive unless ``threads`` fixes it.
        self.window = AdaptiveWindow(start=2, hi=max(1, max_in_flight), budget=memory_budget) if threads is None \
            else AdaptiveWindow(start=threads, lo=threads, hi=threads, fixed=True)
        self._fds: dict[str, int] = {}
        #: ``O_DIRECT`` descriptors for pooled reads (None: the file system refuses it).
        self._dfds: dict[str, int | None] = {}
        self._direct = direct
        self._nowait = direct and hasattr(os, "RWF_NOWAIT")
        self._files: dict[int, dict[str, str | None]] = {}
        if self.layout == "blob":
            self._map_files()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.window.hi, thread_name_prefix="eaglenest-read")

    @property
    def threads(self) -> int:
        """The samples in flight now (the window's current size)."""
        return self.window.current()

    def _map_files(self) -> None:
        """fragment id -> tensor column -> local data file holding it (None: not a local file)."""
        ids = {c: self.ds.lance_schema.field(c).id() for c in S.TENSOR_COLUMNS}
        root = Path(str(self.ds.uri))
        remote = "://" in str(self.ds.uri) and not str(self.ds.uri).startswith("file://")
        for frag in self.ds.get_fragments():
            files = {}
            for col, fid in ids.items():
                paths = [df.path for df in frag.data_files() if fid in df.fields]
                path = root / "data" / paths[0] if len(paths) == 1 and not remote else None
                files[col] = str(path) if path is not None and path.is_file() else None
            self._files[frag.fragment_id] = files
        for files in self._files.values():
            for path in files.values():
                if path is not None and path not in self._fds:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                    self._dfds[path] = _open_direct(path) if self._direct else None

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        fds, self._fds = self._fds, {}
        dfds, self._dfds = self._dfds, {}
        for fd in [*fds.values(), *(d for d in dfds.values() if d is not None)]:
            os.close(fd)

    def take(self, index: int) -> Sample:
        """One sample by dataset offset (synchronous)."""
        index = int(index)
        if self.layout == "inline":
            return self._take_inline(index)
        return self._from_row(self._group([index]), 0, index)

    def _take_inline(self, index: int, into: Into | None = None) -> Sample:
        with _section(self.profile, "take (version-1 row)"):
            t = self._take([index], COLUMNS)
        if t.num_rows != 1:
            raise SchemaError(f"take of row {index} returned {t.num_rows} rows")
        s = Sample(index=index, meta=self.meta, input_ids=_list_values(t.column("input_ids")),
                   loss_mask=_list_values(t.column("loss_mask")), _aux=_binary_value(t.column("aux_hidden")),
                   _last=_binary_value(t.column("last_hidden")), _table=t)
        if into is not None:
            self._convert(s, into)
        return s

    def _group(self, indices: list[int]) -> _Group:
        """One ``take`` of the small columns, blob descriptors and row addresses (request order)."""
        with _section(self.profile, "take (small columns + descriptors)"):
            t = self._take(indices, [*COLUMNS, "_rowaddr"])
        if t.num_rows != len(indices):
            raise SchemaError(f"take of {len(indices)} rows returned {t.num_rows}")
        with _section(self.profile, "descriptor lookup"):
            return _Group.of(t)

    def _take(self, indices: list[int], columns: list[str]) -> pa.Table:
        """``dataset.take``; a Lance error (a truncated or damaged data file) names the fragment."""
        try:
            return self.ds.take(indices, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise read_error(self.ds, indices, exc) from None

    def _where(self, frag: int, path: str) -> str:
        return f"table v{self.ds.version}: fragment {frag}, data file {path}"

    def _from_row(self, g: _Group, k: int, index: int, into: Into | None = None) -> Sample:
        """Sample ``index`` from row ``k`` of a group: its values ``pread`` into buffers, or
        (``into``) into the destination tensors."""
        frag = int(g.frags[k])
        ids = g.ids[g.ids_off[k]:g.ids_off[k + 1]]
        mask = g.mask[g.mask_off[k]:g.mask_off[k + 1]]
        s = Sample(index=index, meta=self.meta, input_ids=ids, loss_mask=mask, _aux=None, _last=None, _table=g.table)
        if into is not None and self._read_direct(g, k, s, frag, into):
            return s
        pool = self._scratch if into is not None else self.pool
        aux, aux_owner = self._blob(g, k, index, frag, "aux_hidden", pool)
        last, last_owner = self._blob(g, k, index, frag, "last_hidden", pool)
        s._aux, s._last = aux, last
        if into is not None:
            self._convert(s, into)
            for b in (aux_owner, last_owner):
                self._scratch.put(b)
            s._aux = s._last = None
        elif self.pool is not None:
            s._pool, s._owned = self.pool, (aux_owner, last_owner)
        return s

    def _convert(self, s: Sample, into: Into) -> None:
        """The converting copy of a held sample into its destination (dtype, layer order, fp8)."""
        n = into.aux.shape[0]
        with _section(self.profile, "convert into destination", 2 * n * s.meta.hidden_size * (s.num_aux + 1)):
            s.aux_into(into.aux, order=into.order)
            s.last_into(into.last)

    def _read_direct(self, g: _Group, k: int, s: Sample, frag: int, into: Into) -> bool:
        """Read both values straight into ``into`` when the bytes are already what it holds: a local
        file read through the page cache (no ``O_DIRECT``), raw storage, the destination in the
        stored dtype and contiguous. False otherwise."""
        m = self.meta
        files = self._files.get(frag, {})
        if (m.storage != "raw" or into.aux.dtype != stored_torch_dtype(m) or into.last.dtype != into.aux.dtype
                or not (into.aux.is_contiguous() and into.last.is_contiguous())
                or any(files.get(c) is None for c in S.TENSOR_COLUMNS)
                or any(self._dfds.get(files[c]) is not None for c in S.TENSOR_COLUMNS)):
            return False  # (with O_DIRECT the disk fills a pooled buffer and one copy places it)
        T, n, L, H = s.num_tokens, into.aux.shape[0], s.num_aux, m.hidden_size
        esize = into.aux.element_size()
        if n > T or tuple(into.aux.shape) != (n, L, H) or tuple(into.last.shape) != (n, H):
            raise SchemaError(f"row {s.index}: destination {tuple(into.aux.shape)} / {tuple(into.last.shape)} "
                              f"does not fit a sample of {T} tokens, {L} aux layers, hidden {H}")
        for col, per_token in (("aux_hidden", L * H * esize), ("last_hidden", H * esize)):
            if int(g.size[col][k]) != T * per_token:
                raise SchemaError(f"row {s.index}: {col} holds {int(g.size[col][k])} bytes, not {T} tokens of "
                                  f"{per_token}")
        order = list(range(L)) if into.order is None else [int(j) for j in into.order]
        aux_mv = memoryview(into.aux.view(-1).view(_torch().uint8).numpy())
        last_mv = memoryview(into.last.view(-1).view(_torch().uint8).numpy())
        path = files["aux_hidden"]
        where = self._where(frag, path)
        if order == list(range(L)):
            with _section(self.profile, "pread into destination", len(aux_mv)):
                _pread_into(self._fds[path], aux_mv, int(g.pos["aux_hidden"][k]), where=where)
        else:  # the layer reorder done by the read itself: one iovec per run of layers in order
            with _section(self.profile, "iovec build (layer reorder)"):
                row = L * H * esize
                runs = _scatter_runs(order, L, H * esize)
                bufs = [aux_mv[t * row + a:t * row + a + b] for t in range(n) for a, b in runs]
            with _section(self.profile, "preadv scatter into destination", len(aux_mv)):
                _preadv_all(self._fds[path], bufs, int(g.pos["aux_hidden"][k]), where=where)
        path = files["last_hidden"]
        with _section(self.profile, "pread into destination", len(last_mv)):
            _pread_into(self._fds[path], last_mv, int(g.pos["last_hidden"][k]), where=self._where(frag, path))
        return True

    def _willneed(self, g: _Group) -> None:
        """Ask the kernel to start reading a group's values (``POSIX_FADV_WILLNEED``): the disk
        works on the next samples while this thread copies the current one. Page cache only."""
        with _section(self.profile, "fadvise WILLNEED"):
            for col in S.TENSOR_COLUMNS:
                for frag, p, n in zip(g.frags.tolist(), g.pos[col].tolist(), g.size[col].tolist()):
                    path = self._files.get(int(frag), {}).get(col)
                    if path is not None:
                        os.posix_fadvise(self._fds[path], int(p), int(n), os.POSIX_FADV_WILLNEED)

    def _blob(self, g: _Group, k: int, index: int, frag: int, col: str,
              pool: BufferPool | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(a view of the value's bytes, the pooled buffer holding it or None). Pooled reads of a
        local file: from the page cache if it holds the value (``RWF_NOWAIT``), else ``O_DIRECT``
        (the disk writes into the buffer: no page-cache copy); plain ``pread`` where the file
        system refuses ``O_DIRECT``."""
        size, pos = int(g.size[col][k]), int(g.pos[col][k])
        path = self._files.get(frag, {}).get(col)
        dfd = self._dfds.get(path) if path is not None and pool is not None else None
        start = pos - pos % ALIGN
        span = -(-(pos + size - start) // ALIGN) * ALIGN
        with _section(self.profile, "buffer (pool or fresh)"):
            if pool is not None:
                base, reused = pool.get(span if dfd is not None else size)
            else:
                base, reused = np.empty(size, np.uint8), False
        pages = "mapped pages (pool)" if reused else "fresh pages"
        if path is not None and dfd is not None:
            where = self._where(frag, path)
            if self._nowait:  # warm: a plain copy from the page cache, no disk
                with _section(self.profile, "pread from page cache (RWF_NOWAIT)"):
                    got = _pread_nowait(self._fds[path], base[:size], pos)
                if got:
                    return base[:size], base
            try:
                with _section(self.profile, f"pread O_DIRECT into {pages}", size):
                    _pread_direct(dfd, base[:span], start, pos + size - start, where=where)
                return base[pos - start:pos - start + size], base
            except OSError:  # EINVAL: this file system will not do it; plain reads from now on
                self._dfds[path] = None
        buf = base[:size]
        if path is not None:
            with _section(self.profile, f"pread into {pages}", size):
                _pread_into(self._fds[path], buf, pos, where=self._where(frag, path))
        else:  # not a local file: Lance's blob reader fills the same buffer
            with _section(self.profile, "object-store blob read", size):
                (blob,) = self.ds.take_blobs(col, indices=[index])
                mv, done = memoryview(buf), 0
                while done < buf.size:
                    n = blob.readinto(mv[done:])
                    if not n:
                        raise SchemaError(f"blob {col} of row {index} ended early")
                    done += n
        return buf, (base if pool is not None else None)

    def iter_samples(self, indices: Iterable[int], *, ahead: int | None = None, group: int = 4,
                     into: Sequence[Into] | None = None) -> Iterator[Sample]:
        """Samples in the order of ``indices``; up to ``ahead`` in flight (default: the reader's
        window, adapted from the measured delivery rate as samples are consumed).

        Version 2: the small columns and blob descriptors of ``group`` samples come from one
        ``take`` (a take costs ~ms whatever its size; per sample it was a large share of the read),
        the kernel is asked to read the group's values ahead (``readahead``), then each sample's
        values are ``pread`` on the pool. Version 1: one ``take`` per sample. ``into`` (one
        :class:`Into` per index): each sample's tensors are written there, and the yielded
        samples hold only the small columns."""
        pending: collections.deque = collections.deque()
        todo = [int(i) for i in indices]
        dests = list(into) if into is not None else None
        if dests is not None and len(dests) != len(todo):
            raise ValueError(f"{len(dests)} destinations for {len(todo)} samples")
        step = group if self.layout == "blob" else 1
        prof = self.profile

        def deliver():
            f = pending.popleft()
            with _section(prof, "consumer wait for a sample"):
                s = f.result()
            if ahead is None:
                self.window.record(f.nbytes)
            return s

        try:
            for g0 in range(0, len(todo), step):
                part = todo[g0:g0 + step]
                if self.layout == "blob":
                    grp = self._group(part)
                    jobs = [(self._from_row, grp, k, i) for k, i in enumerate(part)]
                    sizes = [int(grp.size["aux_hidden"][k] + grp.size["last_hidden"][k]) for k in range(len(part))]
                    if self.readahead:
                        self._willneed(grp)
                else:
                    jobs = [(self._take_inline, i) for i in part]
                    sizes = [self.window.sample_bytes or 1] * len(part)
                for j, ((fn, *args), nb) in enumerate(zip(jobs, sizes)):
                    if dests is not None:
                        args.append(dests[g0 + j])
                    if ahead is None and self.window.sample_bytes < nb:
                        self.window.sample_bytes = nb  # the memory bound knows the largest sample before it is read
                    limit = max(1, ahead) if ahead is not None else self.window.current()
                    while len(pending) >= limit:
                        yield deliver()
                    fut = self._pool.submit(fn, *args)
                    fut.nbytes = nb
                    pending.append(fut)
            while pending:
                yield deliver()
        finally:
            for f in pending:
                f.cancel()

    def read(self, indices: Iterable[int], *, into: Sequence[Into] | None = None) -> list[Sample]:
        return list(self.iter_samples(indices, into=into))
