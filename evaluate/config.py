"""The ``evaluate`` section of a recipe."""

from __future__ import annotations

import dataclasses

from eaglenest.engine import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    #: Exported draft directory; empty means ``<workdir>/draft``.
    draft: str = ""
    num_speculative_tokens: int = 3
    temperature: float = 0.0
    max_tokens: int = 160
    #: Prompts drawn from the store's prompts table with this split.
    split: str = "heldout"
    #: At most this many prompts per domain (0 = all).
    max_prompts_per_domain: int = 0
    #: Also decode without speculation and report whether outputs are token-for-token identical.
    check_lossless: bool = True
    engine: EngineConfig = EngineConfig()
