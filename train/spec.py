"""The draft's architecture options as plain dataclasses: sizes and EAGLE-3.1 flags.

Kept apart from :mod:`eaglenest.train.model` (torch, transformers) so that the recipe's train
section (:mod:`eaglenest.train.config`, loaded by every command) builds them without importing
torch, and apart from the config (pyyaml) so that the model imports no YAML (bench/gpu_check.py runs
it where pyyaml may be missing).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftShape:
    """Explicit draft attention / MLP sizes (``train.draft.*``); 0 = the rule of
    :func:`eaglenest.train.model.draft_shape`. The recipe's ``DraftShapeConfig`` has the same fields."""

    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftFlags:
    """EAGLE-3.1 options, all off by default (vLLM's defaults)."""

    norm_before_fc: bool = False        # one RMSNorm over the concatenated aux features
    fc_norm: bool = False               # one RMSNorm per aux layer before fc
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) instead of hidden
    norm_output: bool = False           # next step's hidden = normed output instead of prenorm
