"""Loading a bench script as a module: bench/ is no package, its scripts are run as files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str, prefix: str = "_bench"):
    """``bench/<name>`` executed as a fresh module named ``<prefix>_<stem>`` (not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"{prefix}_{Path(name).stem}", BENCH / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
