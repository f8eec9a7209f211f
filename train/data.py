"""Training rows from the ``features`` table: a global batch plan, per-rank reads, a prefetcher.

Every rank opens the table at the same pinned version and reads only the small columns
(``split``, ``num_tokens``, ``num_loss_tokens``) to build the same global plan. The feature bytes
of a batch are then read with ``dataset.take`` by the rank that trains on them: with W ranks,
rank r gets rows ``r, r+W, ...`` of every global batch, so no rank reads another's shard and
the split never has to fit in RAM. A background thread (:class:`Prefetcher`) reads and collates
the next batches while the current step runs; the time the step waits for it is the data stall.

Reads go through :class:`eaglenest.featurestore.read.reader.SampleReader`: one ``take`` of a
group's small columns and blob descriptors, then each sample's tensor values written straight into
the preallocated batch tensors by the reader's threads (samples in flight chosen by the reader from
the rate it measures), one reader iteration for all the batches a prefetcher asks for
(:meth:`FeatureShards.read_batches`), so the window of reads runs on across batch boundaries. With ``batch_dtype="stored"`` (what the trainer asks for, ``train.source``)
a bf16 table gives a bf16 batch: each value is ``pread`` into its place in the batch, truncated to
the tokens packed, the aux layers put in ascending id order by the same read (a scatter
``preadv``): no buffer, no conversion on the CPU; the trainer's step converts on the device (the
draft's ``fc`` input and the target head's input are cast there anyway, so the numbers are the
same). With ``batch_dtype="float32"`` (the default here) or an fp8 table each value is read into
a pooled buffer and converted once into the batch (dequantised for fp8, layers reordered in the
same copy) on the reader's threads. No Python lists of the tensor columns, no intermediate copies.
The result equals :func:`collate` of the decoded samples (tested), in the batch's dtype.

Trade-off: random access per sample (~ms on local disk) instead of a sequential scan; it keeps the
global plan identical for any world size, which is what makes a 2-rank trajectory equal to a
1-rank one and makes resume a matter of skipping ``step`` batches.

Packing: each epoch shuffles sample order with ``seed + epoch``, then fills rows of at most
``row_tokens`` tokens greedily (0: ``pack_tokens``); a sample longer than that has a row of its own,
truncated to ``pack_tokens``. Documents in a row carry their own ids and restart rotary positions at
0, so nothing attends across documents.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import weakref
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.pread import aligned
from eaglenest.featurestore.read.profile import ReadProfile
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.read.sample import Into, stored_torch_dtype
from eaglenest.featurestore.table import lease, store
from eaglenest.featurestore.table.integrity import check_version, read_error
from eaglenest.train import vocab as V
from eaglenest.train.ttt import Batch

log = logging.getLogger(__name__)


def no_rows_message(version: int, split: str, rows_in_split: int) -> str:
    """Why features ``version`` has nothing to train on: no row of ``split``, or none with a loss token."""
    if rows_in_split:
        return (f"features v{version}: no rows to train on: its {rows_in_split} rows of train.split={split!r} "
                "have no loss token (loss_mask all 0: check how ingest marked the responses, e.g. the chat "
                "template's assistant turns)")
    return f"features v{version}: no rows to train on (check train.split={split!r} and the table version)"


class FeatureShards:
    """A pinned features version, its eligible rows, the global batch plan and per-rank reads.

    The table data source of the trainer (:mod:`eaglenest.train.source`), on a local disk or an
    object store alike."""

    def __init__(self, uri: str, *, version: int | str | None, split: str, pack_tokens: int,
                 batch_rows: int, seed: int, row_tokens: int = 0, read_threads: int | None = None,
                 table: str = "features",
                 batch_dtype: str = "float32", profile: ReadProfile | None = None, direct: bool = False):
        self.uri, self.table = uri, table
        #: What provenance names as the run's input table.
        self.input_table = table
        self.ds = store.dataset(uri, table, version)
        self.version = int(self.ds.version)
        # While this run reads the version, `featurestore gc` keeps it (featurestore/table/lease.py).
        self._pin = contextlib.ExitStack()
        self._pin.enter_context(lease.pin(uri, table, self.version))
        # A gc between the open and the pin may have removed that version: opened again, by its number, it is
        # now either kept for this run or named missing in one line.
        self.ds = store.dataset(uri, table, self.version)
        self.meta = S.feature_meta(self.ds.schema)
        self.split = split
        # Before anything is read, this scan included: every data file of the version against its
        # CRC sidecar (one stat per file once stamped; featurestore/table/integrity.py).
        check_version(self.ds, table=table)
        try:
            small = self.ds.to_table(columns=["split", "num_tokens", "num_loss_tokens"])
        except (OSError, pa.ArrowException) as exc:  # a data file without a checksum, damaged
            raise read_error(self.ds, None, exc) from None
        in_split = np.asarray(small.column("split").to_pylist()) == split
        ok = in_split & (small.column("num_loss_tokens").to_numpy() > 0)
        #: dataset offsets of the eligible rows, in table order (``take`` indices).
        self.offsets = np.nonzero(ok)[0]
        if len(self.offsets) == 0:
            self._pin.close()
            raise StoreError(no_rows_message(self.version, split, int(in_split.sum())))
        self.lengths = small.column("num_tokens").to_numpy()[self.offsets].astype(np.int64)
        self.pack_tokens, self.batch_rows, self.seed, self.row_tokens = pack_tokens, batch_rows, seed, row_tokens
        # vLLM concatenates aux states in ascending layer order; reorder if the table does not.
        self.aux_order = aux_order(self.meta.layer_ids)
        if batch_dtype not in ("float32", "stored"):
            raise ValueError(f"batch_dtype must be 'float32' or 'stored', not {batch_dtype!r}")
        #: dtype of the batch's aux/last: the stored one for raw tables ("stored"), else float32.
        self.batch_dtype = stored_torch_dtype(self.meta) if batch_dtype == "stored" and self.meta.storage == "raw" \
            else torch.float32
        self.profile = profile
        #: Reused memory of the batches' aux/last tensors (its pages mapped once, not every batch).
        self._arenas = BatchArenas()
        # Samples in flight: adaptive (None) or fixed; values read into the batch (see the module docstring).
        self.reader = SampleReader(self.ds, threads=read_threads, recycle=True, integrity="off",  # checked above
                                   profile=profile, direct=direct)
        if int((self.lengths > pack_tokens).sum()):
            log.warning("%d samples longer than train.pack_tokens=%d are truncated",
                        int((self.lengths > pack_tokens).sum()), pack_tokens)

    def close(self) -> None:
        """Stop the reader and release the version's pin (gc may remove the version afterwards)."""
        self.reader.close()
        self._pin.close()

    @property
    def num_rows(self) -> int:
        return len(self.offsets)

    def loss_token_counts(self, vocab_size: int) -> np.ndarray:
        """Per-target-id counts of loss tokens of the eligible rows: one SQL aggregate over the
        pinned version (featurestore query), not in Python."""
        return V.count_loss_tokens_in_store(self.uri, version=self.version, split=self.split, table=self.table,
                                            vocab_size=vocab_size)

    def start(self, schedule: list[tuple[int, list[list[int]]]], *, world_size: int = 1) -> None:
        """Nothing to start: :meth:`read` reads any rows on demand (the stream needs its order first)."""

    def token_batches(self):
        """Record batches of (input_ids, loss_mask) of the eligible rows (for the vocab count)."""
        return self.ds.take(self.offsets.tolist(), columns=["input_ids", "loss_mask"]).to_batches()

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Global batches -> rows -> eligible-row indices, for one epoch."""
        return plan_batches(self.lengths, pack_tokens=self.pack_tokens, batch_rows=self.batch_rows,
                            seed=self.seed, epoch=epoch, row_tokens=self.row_tokens)

    def read(self, rows: list[list[int]]) -> Batch:
        """Read and collate ``rows`` (eligible-row indices): pack each row, pad to the longest.

        Equal to ``collate([[decode(i) for i in row] for row in rows])`` in :attr:`batch_dtype`;
        each sample's tensors are written once, straight into the batch (see the module docstring)."""
        return next(self.read_batches([rows]))

    def read_batches(self, batches: Iterable[list[list[int]]]) -> Iterator[Batch]:
        """:meth:`read` of each item of ``batches``, in order, with the reads pipelined across batch
        boundaries: the next batch's first samples are already in flight while this batch's last
        ones finish (one reader iteration over all of them), so the reader's window never drains
        between batches. ``batches`` is consumed lazily, as the window reaches it."""
        open_ = collections.deque()  # _Layout of the batches whose samples are being read, in order
        queued: collections.deque = collections.deque()  # the Into of each index handed to the reader

        def indices():
            for rows in batches:
                lay = self._layout(rows)
                open_.append(lay)
                for place, into in zip(lay.places, lay.into):
                    queued.append(into)
                    yield place[0]

        def dests():
            while True:
                yield queued.popleft()

        samples = self.reader.iter_samples(indices(), into=dests())
        done = 0  # samples of open_[0] placed so far
        for s in samples:
            while not open_[0].places[done:]:  # a batch without samples
                yield open_.popleft().batch
                done = 0
            lay = open_[0]
            self._place(lay, lay.places[done], s)
            done += 1
            if done == len(lay.places):
                yield open_.popleft().batch
                done = 0
        while open_:  # only batches without samples can be left
            yield open_.popleft().batch

    def _layout(self, rows: list[list[int]]) -> "_Layout":
        """A batch's tensors (from the arenas) and where each of its samples goes, in dataset order."""
        m, prof = self.meta, self.profile
        B, L, H = len(rows), len(m.layer_ids), m.hidden_size
        n_of = [[min(int(self.lengths[i]), self.pack_tokens) for i in row] for row in rows]
        width = max((sum(ns) for ns in n_of), default=0)
        with (prof.section("batch tensors (allocate)") if prof else contextlib.nullcontext()):
            input_ids = torch.zeros(B, width, dtype=torch.long)
            loss_mask = torch.zeros(B, width, dtype=torch.bool)
            doc_ids = torch.full((B, width), -1, dtype=torch.long)
            position_ids = torch.zeros(B, width, dtype=torch.long)
            aux, last = self._arenas.tensors([(B, width, L * H), (B, width, H)], self.batch_dtype)
        order = self.aux_order.tolist()
        # Every placement (row b, token at, n tokens), read in dataset order (locality on disk).
        places = []
        for b, row in enumerate(rows):
            at = 0
            for d, (i, n) in enumerate(zip(row, n_of[b])):
                places.append((int(self.offsets[i]), i, b, d, at, n))
                at += n
            aux[b, at:].zero_()
            last[b, at:].zero_()
        places.sort()
        into = [Into(aux=aux[b, at:at + n].view(n, L, H), last=last[b, at:at + n], order=order)
                for _, _, b, _, at, n in places]
        batch = Batch(input_ids=input_ids, loss_mask=loss_mask, aux=aux, last_hidden=last,
                      doc_ids=doc_ids, position_ids=position_ids)
        return _Layout(batch=batch, places=places, into=into)

    def _place(self, lay: "_Layout", place: tuple, s) -> None:
        """The small columns of sample ``s`` into its place (its tensors are already there)."""
        _, i, b, d, at, n = place
        prof, bt = self.profile, lay.batch
        if s.num_tokens != int(self.lengths[i]):
            raise StoreError(f"features row {s.index}: {s.num_tokens} token ids, num_tokens says "
                             f"{int(self.lengths[i])}")
        with (prof.section("ids, mask, positions into batch") if prof else contextlib.nullcontext()):
            bt.input_ids[b, at:at + n] = torch.from_numpy(s.input_ids[:n].astype(np.int64))
            bt.loss_mask[b, at:at + n] = torch.from_numpy(s.loss_mask[:n] != 0)
            bt.doc_ids[b, at:at + n] = d
            bt.position_ids[b, at:at + n] = torch.arange(n)


@dataclasses.dataclass
class _Layout:
    """One batch being read: its tensors, its samples' places (dataset offset, eligible row, row b,
    doc d, token at, n tokens) in read order, and each place's destination."""

    batch: Batch
    places: list
    into: list


class BatchArenas:
    """Memory for the batches' feature tensors, reused once nothing holds a batch made from it.

    A fresh batch's pages are faulted in while the reads fill them, and on the 2-core VM that
    first touch cost more than the disk (the trainer arm of ``bench/featurestore_read.py
    --profile``). So each batch's aux and last tensors are views of an arena (a numpy buffer)
    that is handed out again when no tensor made from it is alive: every torch tensor made with
    ``torch.from_numpy`` keeps the numpy view it was made from alive (views of it included), so a
    weak reference to that numpy view says whether any batch, or a view of one, still uses the
    memory. At most ``keep`` idle arenas are kept; the live ones are the batches the trainer and
    the prefetcher hold.
    """

    def __init__(self, keep: int = 3):
        self.keep = keep
        #: [arena, weak references to the numpy views handed out from it]
        self._arenas: list[tuple[np.ndarray, list]] = []
        #: Arenas allocated (a steady run stops allocating after the first few batches).
        self.allocated = 0

    def _idle(self) -> list[int]:
        return [k for k, (_, refs) in enumerate(self._arenas) if all(r() is None for r in refs)]

    def tensors(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Uninitialised tensors of ``shapes`` and ``dtype``, laid out one after another in an idle
        arena (a new one if none is big enough)."""
        esize = torch.empty((), dtype=dtype).element_size()
        sizes = [int(np.prod(s)) * esize for s in shapes]
        need = sum(-(-n // 64) * 64 for n in sizes)
        idle = self._idle()
        fits = [k for k in idle if self._arenas[k][0].size >= need]
        if fits:
            arena, refs = self._arenas[min(fits, key=lambda k: self._arenas[k][0].size)]
        else:
            for k in sorted(sorted(idle, key=lambda k: self._arenas[k][0].size)[:max(0, len(idle) + 1 - self.keep)],
                            reverse=True):
                del self._arenas[k]  # the smallest idle ones make room
            arena, refs = aligned(need + (need >> 3)), []  # some slack for a wider next batch; huge pages
            self._arenas.append((arena, refs))
            self.allocated += 1
        refs.clear()
        out, at = [], 0
        for shape, n in zip(shapes, sizes):
            if n == 0:  # an empty batch: nothing to view
                out.append(torch.empty(shape, dtype=dtype))
                continue
            view = arena[at:at + n]
            refs.append(weakref.ref(view))
            out.append(torch.from_numpy(view).view(dtype).view(shape))
            at += -(-n // 64) * 64
        return out


def plan_batches(lengths, *, pack_tokens: int, batch_rows: int, seed: int, epoch: int,
                 row_tokens: int = 0) -> list[list[list[int]]]:
    """One epoch's plan over samples of ``lengths``: a seeded shuffle, samples packed greedily into
    rows of at most ``row_tokens`` (0: ``pack_tokens``), ``batch_rows`` rows per global batch. A sample
    longer than ``row_tokens`` has a row of its own, truncated to ``pack_tokens``."""
    fill = row_tokens or pack_tokens
    order = np.random.default_rng(seed + epoch).permutation(len(lengths))
    rows, cur, used = [], [], 0
    for i in order.tolist():
        n = min(int(lengths[i]), pack_tokens)
        if cur and used + n > fill:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        rows.append(cur)
    return [rows[j:j + batch_rows] for j in range(0, len(rows), batch_rows)]


def aux_order(layer_ids) -> torch.Tensor:
    """Positions of the stored aux layers in ascending layer-id order (the draft's fc input order)."""
    return torch.as_tensor(np.argsort(np.asarray(layer_ids), kind="stable"))


def rank_rows(rows: list[list[int]], rank: int, world_size: int) -> tuple[list[list[int]], bool]:
    """This rank's rows of a global batch; (rows, ghost). A rank left without rows (last batch)
    gets the batch's first row as a ghost: it runs the step for the collectives, with no loss."""
    mine = rows[rank::world_size]
    return (mine, False) if mine else (rows[:1], True)


def collate(rows) -> Batch:
    """Rows of decoded samples (ids, mask, aux, last) -> a padded Batch; padding has doc id -1."""
    built = []
    for parts in rows:
        doc = torch.cat([torch.full((p[0].shape[0],), d, dtype=torch.long) for d, p in enumerate(parts)])
        pos = torch.cat([torch.arange(p[0].shape[0]) for p in parts])
        built.append((*(torch.cat([p[j] for p in parts]) for j in range(4)), doc, pos))
    width = max(b[0].shape[0] for b in built)

    def pad(x: torch.Tensor, fill) -> torch.Tensor:
        extra = width - x.shape[0]
        return torch.cat([x, x.new_full((extra, *x.shape[1:]), fill)]) if extra else x

    return Batch(
        input_ids=torch.stack([pad(b[0], 0) for b in built]),
        loss_mask=torch.stack([pad(b[1], False) for b in built]),
        aux=torch.stack([pad(b[2], 0.0) for b in built]),
        last_hidden=torch.stack([pad(b[3], 0.0) for b in built]),
        doc_ids=torch.stack([pad(b[4], -1) for b in built]),
        position_ids=torch.stack([pad(b[5], 0) for b in built]),
    )


class Prefetcher:
    """Reads this rank's batches on a background thread, ``depth`` steps ahead.

    Iterating yields (epoch, global rows, local Batch, ghost). ``wait_seconds`` accumulates the
    time the consumer blocked on the queue: the data stall. Lance reads release the GIL, so the
    thread overlaps with the step; it must not fork (Lance is not fork-safe), and it does not.
    """

    def __init__(self, data: FeatureShards, schedule: list[tuple[int, list[list[int]]]], *,
                 rank: int, world_size: int, depth: int = 2):
        self.wait_seconds = 0.0
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()

        def work() -> None:
            steps: collections.deque = collections.deque()  # (epoch, rows, ghost) of the batches asked for

            def mine():
                for epoch, rows in schedule:
                    local, ghost = rank_rows(rows, rank, world_size)
                    steps.append((epoch, rows, ghost))
                    yield local

            # A table source pipelines its reads across batches; any other source reads batch by batch.
            reads = data.read_batches(mine()) if hasattr(data, "read_batches") else map(data.read, mine())
            try:
                for batch in reads:
                    epoch, rows, ghost = steps.popleft()
                    item = (epoch, rows, batch, ghost)
                    while not self._stop.is_set():
                        try:
                            self._q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
                self._q.put(None)
            except BaseException as exc:  # surfaced in the consumer
                self._q.put(exc)
            finally:
                if hasattr(reads, "close"):
                    reads.close()  # reads still in flight are cancelled

        self._thread = threading.Thread(target=work, name="eaglenest-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[tuple[int, list[list[int]], Batch, bool]]:
        while True:
            t0 = time.perf_counter()
            item = self._q.get()
            self.wait_seconds += time.perf_counter() - t0
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
