"""Serve tests reuse the train test helpers (loaded by path: tests are not packages)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synth():
    path = Path(__file__).parent.parent / "train" / "synth.py"
    spec = importlib.util.spec_from_file_location("_eaglenest_test_synth_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
