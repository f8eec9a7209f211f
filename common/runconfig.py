"""The ``run`` section: where a run lives and which target it serves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from eaglenest.config import short
from eaglenest.errors import ConfigError

#: Seeds feed numpy (>= 0) and torch (< 2**64); this range suits both, with room for seed + epoch.
SEED_RANGE = range(0, 2**63)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetKeys:
    """Names of the target tensors the draft needs, in the target's safetensors. Empty: found from
    the config and the weight map (nested language towers of multimodal checkpoints included)."""

    embed: str = ""
    norm: str = ""
    lm_head: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    #: Directory for every output of this run (store, checkpoints, draft, reports).
    workdir: str = "runs/toy"
    #: Target model: a local Hugging Face directory (the tiny target by default) or a hub id.
    target: str = "assets/tiny-target"
    #: LanceDB directory of the feature store; empty means ``<workdir>/store``.
    store: str = ""
    seed: int = 0
    #: Run the target's own Python code (``auto_map`` in its config / tokenizer_config), as
    #: transformers' and vLLM's ``trust_remote_code`` do. Off by default: only for checkpoints you trust.
    trust_remote_code: bool = False
    #: Override where the draft finds the target's embeddings, final norm and lm_head.
    target_keys: TargetKeys = TargetKeys()
    #: The prompts table records which target generated its responses; capture and train refuse
    #: another target unless this says the data is meant to be off-policy.
    off_policy: bool = False

    def __post_init__(self) -> None:
        if self.seed not in SEED_RANGE:
            raise ConfigError(f"run.seed: must be in [0, 2**63), got {short(self.seed)}")

    @property
    def store_uri(self) -> str:
        return self.store or str(Path(self.workdir) / "store")

    def path(self, *parts: str) -> Path:
        return Path(self.workdir, *parts)
