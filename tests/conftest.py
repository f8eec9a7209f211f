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


#: A Qwen3-style generation prompt: ``enable_thinking`` true opens a think block, false renders an
#: empty one, unset renders neither (the tiny target's own template otherwise).
THINKING_PROMPT = ("{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined %}"
                   "{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
                   "{% endif %}")


@pytest.fixture(scope="session")
def thinking_target(tmp_path_factory) -> Path:
    """A copy of the tiny target whose chat template renders ``enable_thinking`` (reasoning tests)."""
    import json
    import shutil

    dst = tmp_path_factory.mktemp("thinking") / "target"
    shutil.copytree(TINY_TARGET, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    plain = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    assert plain in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(plain, THINKING_PROMPT)
    path.write_text(json.dumps(cfg, indent=2))
    return dst
