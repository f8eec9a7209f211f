"""Feature-store test fixtures: the synthetic-row helper module on sys.path (also for subprocesses)."""

import sys
from pathlib import Path

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
