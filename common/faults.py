"""Fault-injection points for tests: named delays switched on by an environment variable.

``EAGLENEST_FAULT_DELAY="ingest.before_commit=0.4"`` makes :func:`delay` sleep 0.4 s whenever the
code passes the point ``ingest.before_commit``. Crash tests use it to hold a run inside a window
that matters (fragments written, commit not yet made) long enough for an external SIGKILL to land
there, whatever the machine's speed. Unset (the default), every point is a no-op.
"""

from __future__ import annotations

import os
import time

ENV = "EAGLENEST_FAULT_DELAY"


def delays(spec: str) -> dict[str, float]:
    """Parse ``point=seconds[,point=seconds...]``."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, secs = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}: '{item}' is not point=seconds")
        out[name.strip()] = float(secs)
    return out


def delay(point: str) -> None:
    spec = os.environ.get(ENV)
    if spec:
        seconds = delays(spec).get(point, 0.0)
        if seconds > 0:
            time.sleep(seconds)
