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
by more than 5% and turns back when it does not, between 2 and ``max_in_flight``, and never beyond
``memory_budget`` bytes of samples in flight (the largest sample seen sets the bound; one sample at
least). Not below 2: with one sample in flight the disk waits while the consumer works, the slowest
fixed window in every side-by-side run (BENCHMARKS.md), and on a noisy disk the rate comparison
alone walked the window down to 1 (a profiled read went 2, 3, 2, 1, 2, 1). ``threads=N``
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
import itertools
import os
import resource
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.pread import (ALIGN, BufferPool, open_direct, pread_direct, pread_into,
                                               pread_nowait, preadv_all, scatter_runs)
from eaglenest.featurestore.read.profile import ReadProfile, section
from eaglenest.featurestore.read.sample import (Into, Sample, binary_value, list_values, stored_torch_dtype,
                                                torch_module)
from eaglenest.featurestore.read.window import MEMORY_BUDGET, AdaptiveWindow
from eaglenest.featurestore.table.base import whole_number
from eaglenest.featurestore.table.integrity import check_version, read_error

COLUMNS = ["input_ids", "loss_mask", "aux_hidden", "last_hidden"]


#: Descriptors left for everything else when the reader's data files are counted (Lance, DuckDB, logs).
SPARE_FDS = 256


def make_room_for_files(count: int, what: str) -> None:
    """Let this process keep ``count`` more files open: the reader holds one descriptor per data file
    of the version (a table of many small commits has thousands; a common soft limit is 1024). The soft
    ``RLIMIT_NOFILE`` is raised toward the hard one as needed; past the hard one, a :class:`StoreError`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + count + SPARE_FDS if os.path.isdir("/proc/self/fd") \
        else count + SPARE_FDS
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise StoreError(f"{what}: {count} data files to keep open, more than this process may open "
                         f"(ulimit -n: soft {soft}, hard {hard}); run `featurestore compact` (fewer, larger "
                         "files) or raise the hard limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


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
        #: Rows of the pinned version: a ``take`` index outside ``[0, num_rows)`` is refused by name.
        self.num_rows = ds.count_rows()
        #: Samples in flight: adaptive unless ``threads`` fixes it.
        self.window = AdaptiveWindow(start=2, lo=min(2, max(1, max_in_flight)), hi=max(1, max_in_flight),
                                     budget=memory_budget) if threads is None \
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
        local_files = {p for files in self._files.values() for p in files.values() if p is not None}
        make_room_for_files(len(local_files) * (2 if self._direct else 1), f"table v{self.ds.version}")
        for files in self._files.values():
            for path in files.values():
                if path is not None and path not in self._fds:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                    self._dfds[path] = open_direct(path) if self._direct else None

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
        index = self._row(index)
        if self.layout == "inline":
            return self._take_inline(index)
        return self._from_row(self._group([index]), 0, index)

    def _row(self, index) -> int:
        """A row number as an int (numpy integers too); a float (``1.5``), a bool or anything else is one
        :class:`StoreError` line, not truncated to another row."""
        if (row := whole_number(index)) is not None:
            return row
        raise StoreError(f"table v{self.ds.version}: row {index!r} is not a row number (an integer; "
                         f"the version has {self.num_rows} rows: 0..{self.num_rows - 1})")

    def _take_inline(self, index: int, into: Into | None = None) -> Sample:
        with section(self.profile, "take (version-1 row)"):
            t = self._take([index], COLUMNS)
        if t.num_rows != 1:
            raise SchemaError(f"take of row {index} returned {t.num_rows} rows")
        s = Sample(index=index, meta=self.meta, input_ids=list_values(t.column("input_ids")),
                   loss_mask=list_values(t.column("loss_mask")), _aux=binary_value(t.column("aux_hidden")),
                   _last=binary_value(t.column("last_hidden")), _table=t)
        if into is not None:
            self._convert(s, into)
        return s

    def _group(self, indices: list[int]) -> _Group:
        """One ``take`` of the small columns, blob descriptors and row addresses (request order)."""
        with section(self.profile, "take (small columns + descriptors)"):
            t = self._take(indices, [*COLUMNS, "_rowaddr"])
        if t.num_rows != len(indices):
            raise SchemaError(f"take of {len(indices)} rows returned {t.num_rows}")
        with section(self.profile, "descriptor lookup"):
            return _Group.of(t)

    def _take(self, indices: list[int], columns: list[str]) -> pa.Table:
        """``dataset.take``; a Lance error (a truncated or damaged data file) names the fragment."""
        outside = [i for i in indices if not 0 <= i < self.num_rows]
        if outside:  # Lance would report it as a fragment that fails to read (or numpy overflow)
            raise StoreError(f"table v{self.ds.version}: row {outside[0]} is out of range "
                             f"(the version has {self.num_rows} rows: 0..{self.num_rows - 1})")
        try:
            return self.ds.take(indices, columns=columns)
        except (OSError, pa.ArrowException) as exc:
            raise self._collected() or read_error(self.ds, indices, exc, columns=columns) from None

    def _collected(self) -> StoreError | None:
        """The error for a version removed by ``featurestore gc`` since this reader opened it (its
        data files with it; None if the table still has it). A read then failed with "reading rows
        failed ... run `featurestore verify`", which finds nothing wrong with the table."""
        try:
            kept = [int(v["version"]) for v in self.ds.versions()]
        except (OSError, ValueError, RuntimeError):  # the table itself is unreadable: read_error says so
            return None
        if not kept or self.ds.version in kept:
            return None
        name = Path(str(self.ds.uri)).name.removesuffix(".lance")
        return StoreError(f"table '{name}' v{self.ds.version} was garbage-collected while it was being read "
                          f"(`featurestore gc`; the versions kept are {min(kept)}..{max(kept)}): tag the version "
                          "to keep it, or read a kept one")

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
        with section(self.profile, "convert into destination", 2 * n * s.meta.hidden_size * (s.num_aux + 1)):
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
        order = list(range(L)) if into.order is None else [int(j) for j in into.order]
        if sorted(order) != list(range(L)):  # a layer twice or left out: the scatter read places each
            return False  # stored layer once, so the converting copy (a gather) takes such an order
        esize = into.aux.element_size()
        if n > T or tuple(into.aux.shape) != (n, L, H) or tuple(into.last.shape) != (n, H):
            raise SchemaError(f"row {s.index}: destination {tuple(into.aux.shape)} / {tuple(into.last.shape)} "
                              f"does not fit a sample of {T} tokens, {L} aux layers, hidden {H}")
        for col, per_token in (("aux_hidden", L * H * esize), ("last_hidden", H * esize)):
            if int(g.size[col][k]) != T * per_token:
                raise SchemaError(f"row {s.index}: {col} holds {int(g.size[col][k])} bytes, not {T} tokens of "
                                  f"{per_token}")
        aux_mv = memoryview(into.aux.view(-1).view(torch_module().uint8).numpy())
        last_mv = memoryview(into.last.view(-1).view(torch_module().uint8).numpy())
        path = files["aux_hidden"]
        where = self._where(frag, path)
        if order == list(range(L)):
            with section(self.profile, "pread into destination", len(aux_mv)):
                pread_into(self._fds[path], aux_mv, int(g.pos["aux_hidden"][k]), where=where)
        else:  # the layer reorder done by the read itself: one iovec per run of layers in order
            with section(self.profile, "iovec build (layer reorder)"):
                row = L * H * esize
                runs = scatter_runs(order, L, H * esize)
                bufs = [aux_mv[t * row + a:t * row + a + b] for t in range(n) for a, b in runs]
            with section(self.profile, "preadv scatter into destination", len(aux_mv)):
                preadv_all(self._fds[path], bufs, int(g.pos["aux_hidden"][k]), where=where)
        path = files["last_hidden"]
        with section(self.profile, "pread into destination", len(last_mv)):
            pread_into(self._fds[path], last_mv, int(g.pos["last_hidden"][k]), where=self._where(frag, path))
        return True

    def _willneed(self, g: _Group) -> None:
        """Ask the kernel to start reading a group's values (``POSIX_FADV_WILLNEED``): the disk
        works on the next samples while this thread copies the current one. Page cache only."""
        with section(self.profile, "fadvise WILLNEED"):
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
        with section(self.profile, "buffer (pool or fresh)"):
            if pool is not None:
                base, reused = pool.get(span if dfd is not None else size)
            else:
                base, reused = np.empty(size, np.uint8), False
        pages = "mapped pages (pool)" if reused else "fresh pages"
        if path is not None and dfd is not None:
            where = self._where(frag, path)
            if self._nowait:  # warm: a plain copy from the page cache, no disk
                with section(self.profile, "pread from page cache (RWF_NOWAIT)"):
                    got = pread_nowait(self._fds[path], base[:size], pos)
                if got:
                    return base[:size], base
            try:
                with section(self.profile, f"pread O_DIRECT into {pages}", size):
                    pread_direct(dfd, base[:span], start, pos + size - start, where=where)
                return base[pos - start:pos - start + size], base
            except OSError:  # EINVAL: this file system will not do it; plain reads from now on
                self._dfds[path] = None
        buf = base[:size]
        if path is not None:
            with section(self.profile, f"pread into {pages}", size):
                pread_into(self._fds[path], buf, pos, where=self._where(frag, path))
        else:  # not a local file: Lance's blob reader fills the same buffer
            with section(self.profile, "object-store blob read", size):
                self._read_blob(col, index, buf)
        return buf, (base if pool is not None else None)

    def _read_blob(self, col: str, index: int, buf: np.ndarray) -> None:
        """Fill ``buf`` with the value through Lance's blob reader (a data file that is not local). A
        missing or damaged object, or a version gc removed meanwhile, is one :class:`StoreError` (Lance's
        OSError or ValueError 'Not found: ...' reached the caller as a traceback)."""
        try:
            (blob,) = self.ds.take_blobs(col, indices=[index])
            mv, done = memoryview(buf), 0
            while done < buf.size:
                n = blob.readinto(mv[done:])
                if not n:
                    raise SchemaError(f"blob {col} of row {index} ended early")
                done += n
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise self._collected() or read_error(self.ds, [index], exc) from None

    def iter_samples(self, indices: Iterable[int], *, ahead: int | None = None, group: int = 4,
                     into: Sequence[Into] | None = None) -> Iterator[Sample]:
        """Samples in the order of ``indices``; up to ``ahead`` in flight (default: the reader's
        window, adapted from the measured delivery rate as samples are consumed).

        Version 2: the small columns and blob descriptors of ``group`` samples come from one
        ``take`` (a take costs ~ms whatever its size; per sample it was a large share of the read),
        the kernel is asked to read the group's values ahead (``readahead``), then each sample's
        values are ``pread`` on the pool. Version 1: one ``take`` per sample. ``into`` (one
        :class:`Into` per index): each sample's tensors are written there, and the yielded
        samples hold only the small columns. Both may be iterators, consumed in step as the window
        moves (a caller can hand out its next batch's indices without knowing where it ends)."""
        pending: collections.deque = collections.deque()
        if group < 1:  # islice(todo, 0) would end the read at once, every sample silently dropped
            raise ValueError(f"group must be >= 1, not {group}")
        if hasattr(indices, "__len__") and hasattr(into, "__len__") and len(into) != len(indices):
            raise ValueError(f"{len(into)} destinations for {len(indices)} samples")
        todo = iter(indices)
        dests = iter(into) if into is not None else None
        step = group if self.layout == "blob" else 1
        prof = self.profile

        def deliver():
            f = pending.popleft()
            with section(prof, "consumer wait for a sample"):
                s = f.result()
            if ahead is None:
                self.window.record(f.nbytes)
            return s

        try:
            while part := [self._row(i) for i in itertools.islice(todo, step)]:
                if self.layout == "blob":
                    grp = self._group(part)
                    jobs = [(self._from_row, grp, k, i) for k, i in enumerate(part)]
                    sizes = [int(grp.size["aux_hidden"][k] + grp.size["last_hidden"][k]) for k in range(len(part))]
                    if self.readahead:
                        self._willneed(grp)
                else:
                    jobs = [(self._take_inline, i) for i in part]
                    sizes = [self.window.sample_bytes or 1] * len(part)
                for (fn, *args), nb in zip(jobs, sizes):
                    if dests is not None:
                        dest = next(dests, None)
                        if dest is None:
                            raise ValueError("fewer destinations than samples")
                        args.append(dest)
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
