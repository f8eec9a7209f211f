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
mapped. ``threads`` samples are read at once (the GIL is released in ``pread``).
``readahead=True`` also asks the kernel to read a group's values ahead (``POSIX_FADV_WILLNEED``)
once its descriptors are known. It is off by default: on a quiet machine, side by side and cold,
two ``pread`` threads alone were faster in every round (median 1.89 against 1.71 GB/s over 6
rounds; again 1.78 against 1.44);
the extra readahead only helped on a loaded machine, where a descheduled thread leaves the disk
idle (``bench/featurestore_read.py --serial`` times both).
When a data file is not a local file (object storage), Lance's ``BlobFile.readinto`` fills the
same buffer instead. Version-1 tables (inline ``large_binary``) are read with ``take``, zero-copy
views of Lance's output (slower, as above).

Tensors are never turned into Python objects; converting to the trainer's float dtype happens
once, straight into the batch tensor (:meth:`Sample.aux_into`), aux layer reorder and fp8
dequantisation included.

Trade-off: the reader relies on Lance's blob descriptor being a byte range of the data file that
the manifest lists for the fragment (true for Lance blob v1 columns in file format 2.0; checked
against the tensor shape on decode, and ``featurestore verify`` checks every data file's CRC).
Integrity: before the first read, every data file of the version is held to its CRC sidecar
(:func:`eaglenest.featurestore.table.integrity.check_version`: one ``stat`` per file once the file's
stamp is recorded, a full CRC pass otherwise), since a ``pread`` returns whatever bytes the file
holds. A short read or a Lance error while taking a fragment's rows is a :class:`StoreError`
naming the fragment and file. ``integrity="off"`` skips the check (the read bench's baseline).
Memory: at most ``threads`` samples are in flight beyond those the caller holds (RSS), plus up to
``group`` samples read ahead into the page cache (reclaimable, not RSS).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import threading
import warnings
from pathlib import Path
from typing import Iterable, Iterator, Literal

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table.integrity import VERIFY_HINT, check_version, read_error

COLUMNS = ["input_ids", "loss_mask", "aux_hidden", "last_hidden"]


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


@dataclasses.dataclass
class Sample:
    """One row of a features table, its tensors viewing the Arrow buffers it keeps alive."""

    index: int                 # dataset offset (``take`` index)
    meta: S.FeatureMeta
    input_ids: np.ndarray      # int32 [T], view
    loss_mask: np.ndarray      # uint8 [T], view
    _aux: object               # buffer of the aux value (Arrow buffer or numpy bytes)
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
        if m.storage == "raw":
            dt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[m.dtype]
            t = _view(buf).view(dt)
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



class BufferPool:
    """Reusable byte buffers: a recycled buffer's pages are already mapped, so the next value read
    into it costs no page faults (on this VM faulting fresh pages costs about as much as the disk
    read itself: ``bench/featurestore_read.py``'s ``disk`` vs ``raw``). Buffers grow in 8 MiB steps;
    the pool holds at most ``max_free`` idle ones."""

    STEP = 8 << 20

    def __init__(self, max_free: int):
        self.max_free = max_free
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [k for k, b in enumerate(self._free) if b.size >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda k: self._free[k].size))
        return np.empty(-(-max(nbytes, 1) // self.STEP) * self.STEP, np.uint8)

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.max_free:  # drop the smallest (arrays compare elementwise: by index)
                self._free.pop(min(range(len(self._free)), key=lambda k: self._free[k].size))


def _pread_into(fd: int, buf: np.ndarray, position: int, *, where: str = "a data file") -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.preadv(fd, [mv[done:]], position + done)
        except OSError as exc:  # EIO from the disk: name the file, no traceback
            raise StoreError(f"{where}: read failed ({exc}); {VERIFY_HINT}") from None
        if n <= 0:
            raise StoreError(f"{where} ended {len(mv) - done} bytes short of a blob value at byte "
                             f"{position} (truncated?); {VERIFY_HINT}")
        done += n


class SampleReader:
    """Reads samples of one pinned table version, ``threads`` samples in flight.

    One consumer per iterator; :meth:`close` (or ``with``) stops the pool and closes files.
    """

    def __init__(self, ds, *, threads: int = 2, recycle: bool = False, max_free_buffers: int = 16,
                 readahead: bool = False, integrity: Literal["check", "off"] = "check"):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if integrity not in ("check", "off"):
            raise ValueError(f"integrity must be 'check' or 'off', not {integrity!r}")
        self.ds = ds
        if integrity == "check":  # before any read: every data file of this version against its CRC
            check_version(ds)
        #: With ``recycle``, blob values are read into pooled buffers that :meth:`Sample.release`
        #: hands back (version-2 tables; Lance's ``take`` allocates its own on version 1).
        self.pool = BufferPool(max_free_buffers) if recycle else None
        #: Kernel readahead of each group's values once its descriptors are known (see _willneed).
        self.readahead = readahead
        self.meta = S.feature_meta(ds.schema)
        self.layout = S.tensor_layout(ds.schema)
        self.threads = threads
        self._fds: dict[str, int] = {}
        self._files: dict[int, dict[str, str | None]] = {}
        if self.layout == "blob":
            self._map_files()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="eaglenest-read")

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

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def take(self, index: int) -> Sample:
        """One sample by dataset offset (synchronous)."""
        index = int(index)
        if self.layout == "inline":
            t = self._take([index], COLUMNS)
            if t.num_rows != 1:
                raise SchemaError(f"take of row {index} returned {t.num_rows} rows")
            return Sample(index=index, meta=self.meta, input_ids=_list_values(t.column("input_ids")),
                          loss_mask=_list_values(t.column("loss_mask")), _aux=_binary_value(t.column("aux_hidden")),
                          _last=_binary_value(t.column("last_hidden")), _table=t)
        return self._from_row(self._descriptors([index]), 0, index)

    def _descriptors(self, indices: list[int]) -> pa.Table:
        """One ``take`` of the small columns, blob descriptors and row addresses (request order)."""
        t = self._take(indices, [*COLUMNS, "_rowaddr"])
        if t.num_rows != len(indices):
            raise SchemaError(f"take of {len(indices)} rows returned {t.num_rows}")
        return t

    def _take(self, indices: list[int], columns: list[str]) -> pa.Table:
        """``dataset.take``; a Lance error (a truncated or damaged data file) names the fragment."""
        try:
            return self.ds.take(indices, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise read_error(self.ds, indices, exc) from None

    def _from_row(self, t: pa.Table, k: int, index: int) -> Sample:
        """Sample ``index`` from row ``k`` of a :meth:`_descriptors` table: its values ``pread``."""
        row = t.slice(k, 1)
        frag = int(row.column("_rowaddr")[0].as_py()) >> 32
        aux, last = (self._blob(row, index, frag, c) for c in S.TENSOR_COLUMNS)
        owned = (aux.base, last.base) if self.pool is not None else ()
        return Sample(index=index, meta=self.meta,
                      input_ids=_list_values(row.column("input_ids")), loss_mask=_list_values(row.column("loss_mask")),
                      _aux=aux, _last=last, _table=row, _pool=self.pool if owned else None, _owned=owned)

    def _willneed(self, t: pa.Table) -> None:
        """Ask the kernel to start reading a group's values (``POSIX_FADV_WILLNEED``): the disk
        works on the next samples while this thread copies the current one. Page cache only."""
        frags = [int(a) >> 32 for a in t.column("_rowaddr").to_pylist()]
        for col in S.TENSOR_COLUMNS:
            for frag, d in zip(frags, t.column(col).to_pylist()):
                path = self._files.get(frag, {}).get(col)
                if path is not None:
                    os.posix_fadvise(self._fds[path], int(d["position"]), int(d["size"]), os.POSIX_FADV_WILLNEED)

    def _blob(self, t: pa.Table, index: int, frag: int, col: str) -> np.ndarray:
        d = t.column(col)[0].as_py()
        size = int(d["size"])
        buf = self.pool.get(size)[:size] if self.pool is not None else np.empty(size, np.uint8)
        path = self._files.get(frag, {}).get(col)
        if path is not None:
            _pread_into(self._fds[path], buf, int(d["position"]),
                        where=f"table v{self.ds.version}: fragment {frag}, data file {path}")
        else:  # not a local file: Lance's blob reader fills the same buffer
            (blob,) = self.ds.take_blobs(col, indices=[index])
            mv, done = memoryview(buf), 0
            while done < buf.size:
                n = blob.readinto(mv[done:])
                if not n:
                    raise SchemaError(f"blob {col} of row {index} ended early")
                done += n
        return buf

    def iter_samples(self, indices: Iterable[int], *, ahead: int | None = None,
                     group: int = 4) -> Iterator[Sample]:
        """Samples in the order of ``indices``, up to ``ahead`` (default ``threads``) in flight.

        Version 2: the small columns and blob descriptors of ``group`` samples come from one
        ``take`` (a take costs ~ms whatever its size; per sample it was a large share of the read),
        the kernel is asked to read the group's values ahead (``readahead``), then each sample's
        values are ``pread`` on the pool. Version 1: one ``take`` per sample."""
        ahead = self.threads if ahead is None else max(1, ahead)
        pending: collections.deque = collections.deque()
        todo = [int(i) for i in indices]
        try:
            for g in range(0, len(todo), group if self.layout == "blob" else 1):
                part = todo[g:g + (group if self.layout == "blob" else 1)]
                if self.layout == "blob":
                    t = self._descriptors(part)
                    jobs = [(self._from_row, t, k, i) for k, i in enumerate(part)]
                    if self.readahead:
                        self._willneed(t)
                else:
                    jobs = [(self.take, i) for i in part]
                for fn, *args in jobs:
                    pending.append(self._pool.submit(fn, *args))
                    if len(pending) >= ahead:
                        yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()

    def read(self, indices: Iterable[int]) -> list[Sample]:
        return list(self.iter_samples(indices))
