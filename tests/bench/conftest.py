"""tests/bench on sys.path for its helper module (bench_helpers.py), as tests/ingest and tests/featurestore do."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
