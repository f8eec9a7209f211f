"""The ``featurestore`` section of a recipe."""

from __future__ import annotations

import dataclasses

from eaglenest.engine import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeaturestoreConfig:
    #: Aux layers in vLLM's convention; empty means vLLM's EAGLE-3 default (2, L//2, L-3).
    layer_ids: list[int] = dataclasses.field(default_factory=list)
    #: Samples per Lance commit (each commit is atomic; a killed capture resumes after the last).
    commit_every: int = 64
    #: Samples sent to the engine at once.
    batch_size: int = 32
    engine: EngineConfig = EngineConfig()
