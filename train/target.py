"""Read the few target tensors the draft needs, straight from the target's safetensors.

The draft shares the target's token embeddings (frozen) and trains against the target's own
next-token distribution, which needs the final norm and lm_head. Only these three tensors are
read (through the shard index when the checkpoint is sharded), never the whole model: on a real
target that is the difference between megabytes and tens of gigabytes of RAM.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eaglenest.errors import ConfigError

log = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def target_config(target_dir: str | Path) -> dict[str, Any]:
    """The target's ``config.json`` as a dict (text_config of multimodal wrappers not handled)."""
    p = Path(target_dir) / "config.json"
    if not p.is_file():
        raise ConfigError(f"run.target: {target_dir} has no config.json (a local HF model directory "
                          "is required)")
    return json.loads(p.read_text(encoding="utf-8"))


def _weight_files(target_dir: Path) -> dict[str, Path]:
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: target_dir / f for name, f in wm.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"run.target: {target_dir} has no model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def load_target_tensors(target_dir: str | Path) -> dict[str, Any]:
    """{"embed", "norm", "lm_head": tensors (float32), "rms_norm_eps", "config"}."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    cfg = target_config(target_dir)
    files = _weight_files(target_dir)
    names = {"embed": EMBED, "norm": NORM, "lm_head": LM_HEAD}
    if LM_HEAD not in files:
        if not cfg.get("tie_word_embeddings", False):
            raise ConfigError(f"run.target: {target_dir} has no {LM_HEAD} and untied embeddings")
        names["lm_head"] = EMBED
    out: dict[str, Any] = {}
    for key, name in names.items():
        if name not in files:
            raise ConfigError(f"run.target: {target_dir} has no tensor '{name}'")
        with safe_open(str(files[name]), framework="pt") as f:
            out[key] = f.get_tensor(name).float()
    out["rms_norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    out["config"] = cfg
    log.debug("loaded embed/norm/lm_head from %s", target_dir)
    return out


def torch_dtype_name(cfg: dict[str, Any]) -> str:
    """The target's dtype as a string ("float32", "bfloat16", ...)."""
    d = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return str(d).replace("torch.", "")


__all__ = ["load_target_tensors", "target_config", "torch_dtype_name"]
