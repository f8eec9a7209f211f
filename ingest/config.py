"""The ``ingest`` section of a recipe."""

from __future__ import annotations

import dataclasses

from eaglenest.engine import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class IngestConfig:
    #: The domain manifest (YAML); `ingest build --manifest PATH` overrides it.
    manifest: str = "recipes/manifests/toy.yaml"
    #: Prompts per atomic commit to the prompts table; a killed run resumes after the last commit.
    commit_every: int = 64
    engine: EngineConfig = EngineConfig()
