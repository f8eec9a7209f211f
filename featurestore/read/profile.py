"""Where a read's time goes: :class:`ReadProfile` sums seconds, calls and bytes per named step.

The reader wraps each step (take, descriptor lookup, buffer, ``pread``, conversion, the consumer's
wait) in :func:`section`; without a profile a section costs one attribute test.
"""

from __future__ import annotations

import collections
import threading
import time


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


def section(prof: ReadProfile | None, name: str, nbytes: int = 0):
    return _OFF if prof is None else prof.section(name, nbytes)
