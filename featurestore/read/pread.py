"""Reading blob values with ``pread``: pooled aligned buffers, ``O_DIRECT``, page-cache-only tries,
scatter reads (``preadv``) that put aux layers in a wanted order. Errors name the file."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

from eaglenest.errors import StoreError
from eaglenest.featurestore.read.window import MEMORY_BUDGET
from eaglenest.featurestore.table.integrity import VERIFY_HINT

#: Iovecs per ``preadv`` call (Linux's IOV_MAX).
IOV_MAX = 1024
#: Alignment of ``O_DIRECT`` reads (buffer address, file offset, length).
ALIGN = 4096


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
        return aligned(size), False

    def put(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free.append(buf)
            while len(self._free) > 1 and sum(b.size for b in self._free) > self.max_bytes:
                # drop the smallest (arrays compare elementwise: by index)
                k = min(range(len(self._free)), key=lambda k: self._free[k].size)
                self.dropped += self._free.pop(k).size


#: Buffers of at least this many bytes are mapped on their own and asked for huge pages.
HUGE = 2 << 20
#: Off: every buffer plain heap memory in 4 KiB pages (the bench's ``--pages`` arms compare).
HUGE_PAGES = True


def aligned(size: int) -> np.ndarray:
    """``size`` bytes starting on an :data:`ALIGN` boundary (what ``O_DIRECT`` reads need).

    From :data:`HUGE` bytes up, an anonymous mapping of its own, 2 MiB aligned and advised
    ``MADV_HUGEPAGE``: the first read into it faults 2 MiB pages, not 4 KiB ones. On the 2-core VM
    (transparent huge pages on ``madvise``) a cold trainer read into fresh 4 KiB pages fell to a third
    of its speed in 4 rounds of 10, into advised ones in none (BENCHMARKS.md, feature store read).
    The mapping is unmapped when the last view of it goes."""
    if HUGE_PAGES and size >= HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        mm = mmap.mmap(-1, size + HUGE)
        raw = np.frombuffer(mm, np.uint8)
        off = (-raw.ctypes.data) % HUGE
        with contextlib.suppress(OSError):  # advice only: a kernel without THP maps 4 KiB pages
            mm.madvise(mmap.MADV_HUGEPAGE, off - off % mmap.PAGESIZE, size)
        return raw[off:off + size]
    raw = np.empty(size + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off:off + size]


def io_error(exc: OSError, where: str) -> StoreError:
    return StoreError(f"{where}: read failed ({exc}); {VERIFY_HINT}")


def pread_into(fd: int, buf, position: int, *, where: str = "a data file") -> None:
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.preadv(fd, [mv[done:]], position + done)
        except OSError as exc:  # EIO from the disk: name the file, no traceback
            raise io_error(exc, where) from None
        if n <= 0:
            raise StoreError(f"{where} ended {len(mv) - done} bytes short of a blob value at byte "
                             f"{position} (truncated?); {VERIFY_HINT}")
        done += n


def pread_direct(fd: int, buf: np.ndarray, start: int, need: int, *, where: str) -> None:
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
            raise io_error(exc, where) from None
        if n <= 0:
            raise StoreError(f"{where} ended {need - done} bytes short of a blob value at byte "
                             f"{start + done} (truncated?); {VERIFY_HINT}")
        done += n


def open_direct(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) if hasattr(os, "O_DIRECT") else None
    except OSError:  # tmpfs and some network file systems refuse O_DIRECT
        return None


def pread_nowait(fd: int, buf: np.ndarray, position: int) -> bool:
    """Read all of ``buf`` from the page cache only (``RWF_NOWAIT``); False if any of it is not
    cached (nothing is waited for; the caller reads it from the disk)."""
    try:
        n = os.preadv(fd, [memoryview(buf).cast("B")], position, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: an old kernel
        return False
    return n == buf.size


def preadv_all(fd: int, bufs: list[memoryview], position: int, *, where: str) -> None:
    """Fill ``bufs`` in turn from the file range starting at ``position`` (scatter read), at most
    :data:`IOV_MAX` iovecs per call, resuming after short reads."""
    i, pos = 0, position
    bufs = list(bufs)
    while i < len(bufs):
        try:
            n = os.preadv(fd, bufs[i:i + IOV_MAX], pos)
        except OSError as exc:
            raise io_error(exc, where) from None
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


def scatter_runs(order: Sequence[int], n_aux: int, row: int) -> list[tuple[int, int]]:
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
