"""How many samples a reader keeps in flight: :class:`AdaptiveWindow`, from the measured rate."""

from __future__ import annotations

import time

#: Default bound on the bytes of samples in flight (and on the pool's idle buffers).
MEMORY_BUDGET = 512 << 20


class AdaptiveWindow:
    """How many samples a reader keeps in flight, chosen from the delivery rate it measures.

    Every period (``max(min_period, 2 * size)`` deliveries) the rate in bytes per second is
    compared with the rate last measured at the size the window came from: better by more than
    ``tolerance``, the window keeps moving the same way; otherwise it turns back. So it climbs
    while more parallel reads pay (a latency-bound object store, a disk with queue depth) and
    settles low where they do not (a CPU-bound or saturated disk), within ``[lo, hi]`` and within
    ``budget`` bytes of samples in flight (the largest sample seen; the budget wins over ``lo``, down
    to one sample). ``fixed=True``: never moves.
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
        return max(1, min(self.hi, int(by_memory)))

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
