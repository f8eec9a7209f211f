"""Shared fixtures: the repo root, the committed tiny target, and GPU auto-skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_TARGET = ROOT / "assets" / "tiny-target"

# vLLM on CPU: keep engine logs quiet in test output.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    assert (TINY_TARGET / "model.safetensors").is_file(), "the tiny-target fixture is missing"
    return TINY_TARGET
