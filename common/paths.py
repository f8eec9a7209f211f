"""Output directories proven writable before a stage does any expensive work.

A stage that starts an engine (tens of seconds to minutes) and only then finds it cannot write its
store or its ``stats.json`` wastes the run, so each command checks its output directories first.
The check *does* the write (a temporary file is created and removed) rather than asking
``os.access``, which answers yes to root on a read-only mount. Object-store URIs (``s3://...``) are
left to their own client: only local paths are checked.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from eaglenest.errors import EaglenestError, StoreError


def ensure_writable(path: str | Path, key: str, *, error: type[EaglenestError] = StoreError) -> None:
    """Create directory ``path`` if needed and prove it is writable; else ``error`` naming ``key``."""
    text = str(path)
    if "://" in text:
        return
    p = Path(text).expanduser()
    shown = text if len(text) <= 120 else "..." + text[-117:]  # the end of a path says the most
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".eaglenest-write-check-", dir=p)
        os.close(fd)
        os.unlink(tmp)
    except FileExistsError:
        raise error(f"{key}: {shown} is a file, not a directory") from None
    except OSError as exc:
        raise error(f"{key}: cannot write to {shown} ({exc.strerror or type(exc).__name__})") from None
