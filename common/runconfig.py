"""The ``run`` section: where a run lives and which target it serves."""

from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    #: Directory for every output of this run (store, checkpoints, draft, reports).
    workdir: str = "runs/toy"
    #: Target model: a local Hugging Face directory (the tiny target by default) or a hub id.
    target: str = "assets/tiny-target"
    #: LanceDB directory of the feature store; empty means ``<workdir>/store``.
    store: str = ""
    seed: int = 0

    @property
    def store_uri(self) -> str:
        return self.store or str(Path(self.workdir) / "store")

    def path(self, *parts: str) -> Path:
        return Path(self.workdir, *parts)
