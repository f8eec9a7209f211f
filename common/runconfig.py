"""The ``run`` section: where a run lives and which target it serves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eaglenest.config import short
from eaglenest.errors import ConfigError

#: Seeds feed numpy (>= 0) and torch (< 2**64); this range suits both, with room for seed + epoch.
SEED_RANGE = range(0, 2**63)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    #: Directory for every output of this run (store, checkpoints, draft, reports).
    workdir: str = "runs/toy"
    #: Target model: a local Hugging Face directory (the tiny target by default) or a hub id.
    target: str = "assets/tiny-target"
    #: LanceDB directory of the feature store; empty means ``<workdir>/store``.
    store: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seed not in SEED_RANGE:
            raise ConfigError(f"run.seed: must be in [0, 2**63), got {short(self.seed)}")

    @property
    def store_uri(self) -> str:
        return self.store or str(Path(self.workdir) / "store")

    def path(self, *parts: str) -> Path:
        return Path(self.workdir, *parts)
