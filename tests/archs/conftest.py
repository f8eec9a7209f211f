"""Real-architecture test fixtures: the helper module on sys.path, one run directory per architecture."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from arch_helpers import Run, write_prompts  # noqa: E402


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    """``make_run(arch, train=..., on_policy=...)``: the target built into a fresh directory, with a
    recipe (``train`` overrides its train section) and a prompts table (see write_prompts)."""
    def make(arch: str, *, train: dict | None = None, on_policy: bool = False) -> Run:
        run = Run(arch, tmp_path_factory.mktemp(arch), train=train)
        write_prompts(run.store, run.target, on_policy=on_policy)
        return run

    return make
