"""Read the few target tensors the draft needs, straight from the target's safetensors.

The draft shares the target's token embeddings (frozen) and trains against the target's own
next-token distribution, which needs the final norm and lm_head. Only these three tensors are
read (through the shard index when the checkpoint is sharded), never the whole model: on a real
target that is the difference between megabytes and tens of gigabytes of RAM.

Where they are is found from the weight map, not assumed: a plain causal LM keeps them at
``model.embed_tokens.weight`` / ``model.norm.weight`` / ``lm_head.weight``; multimodal wrappers nest
the language model (``model.language_model.embed_tokens.weight``,
``language_model.model.norm.weight``, ...). The embedding is the one ``*embed_tokens.weight``
outside vision/audio towers, the final norm sits beside it (``<prefix>norm.weight``), and lm_head
is the ``*lm_head.weight`` outside the towers, or the embedding when the config ties them.
``run.target_keys.{embed,norm,lm_head}`` name them explicitly when the rule cannot tell.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.target import language_config, local_dir, open_weights, read_config, weight_files

log = logging.getLogger(__name__)

#: Tensor names of a plain causal LM (Llama, Qwen, Mistral, DeepSeek, gpt-oss, MiniMax ...).
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
#: Name parts of non-language towers: never the draft's embeddings, norm or head.
_TOWERS = re.compile(r"(^|\.)(vision|visual|vision_tower|vision_model|audio|audio_tower|multi_modal_projector|"
                     r"mm_projector|image_newline|mtp)(\.|_|$)")
_EMBED_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight")
#: Model types whose RMSNorm scales by (1 + weight) (zero-centred weights: Qwen3-Next, Qwen3.5). The trainer's
#: target head and the draft's norm are plain RMSNorms (x_hat * weight), so they take 1 + the stored weight.
ZERO_CENTRED_NORM = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def target_config(target_dir: str | Path) -> dict[str, Any]:
    """The language model's config (``text_config`` of multimodal wrappers, see eaglenest.target)."""
    return language_config(read_config(target_dir))


def _one(kind: str, found: list[str], target_dir: Path) -> str:
    if len(found) == 1:
        return found[0]
    what = f"several candidates ({', '.join(found[:4])})" if found else "no candidate"
    raise ConfigError(f"run.target: cannot tell the target's {kind} tensor in {target_dir}: {what}; "
                      f"name it with run.target_keys.{kind}=<tensor name>")


def find_keys(names, cfg: dict[str, Any], *, target_dir: Path | str = "",
              overrides: dict[str, str] | None = None) -> dict[str, str]:
    """{"embed", "norm", "lm_head"} -> tensor names in the checkpoint (see the module docstring)."""
    names = set(names)
    given = {k: v for k, v in (overrides or {}).items() if v}
    target_dir = Path(target_dir)
    for kind, name in given.items():
        if name not in names:
            raise ConfigError(f"run.target_keys.{kind}: {target_dir} has no tensor '{name}'")
    lm = [n for n in names if not _TOWERS.search(n)]
    keys = dict(given)
    if "embed" not in keys:
        keys["embed"] = EMBED if EMBED in names else _one(
            "embed", sorted(n for n in lm if n.endswith(_EMBED_SUFFIXES)), target_dir)
    prefix = next((keys["embed"][: -len(s)] for s in _EMBED_SUFFIXES if keys["embed"].endswith(s)), "")
    if "norm" not in keys:
        beside = [p + "norm.weight" for p in (prefix, prefix + "final_") if p + "norm.weight" in names]
        keys["norm"] = beside[0] if beside else _one("norm", [], target_dir)
    if "lm_head" not in keys:
        heads = sorted(n for n in lm if n.endswith(LM_HEAD) or n.endswith("output.weight") and n.count(".") <= 2)
        heads = [LM_HEAD] if LM_HEAD in heads else heads
        if heads:
            keys["lm_head"] = _one("lm_head", heads, target_dir)
        elif cfg.get("tie_word_embeddings", False):
            keys["lm_head"] = keys["embed"]
        else:
            raise ConfigError(f"run.target: {target_dir} has no lm_head tensor and does not tie its embeddings "
                              "(set run.target_keys.lm_head)")
    return keys


def load_target_tensors(target_dir: str | Path, *, keys: dict[str, str] | None = None,
                        only: tuple[str, ...] = ("embed", "norm", "lm_head")) -> dict[str, Any]:
    """{"embed", "norm", "lm_head": tensors (float32), "rms_norm_eps", "config", "keys"}.

    ``keys``: explicit tensor names (``run.target_keys``); ``only``: which of the three to read.
    A hub id is read from its snapshot in the local cache (``target.local_dir``)."""
    target_dir = local_dir(target_dir)
    cfg = target_config(target_dir)
    if str(cfg.get("model_type", "")).startswith("gemma"):
        raise ConfigError(f"run.target: {target_dir} is a Gemma model ({cfg['model_type']}); its final norm "
                          "scales by (1 + weight) and its logits are soft-capped, which the trainer's target head "
                          "does not model yet (docs/targets.md)")
    check_config(cfg, target_dir)
    files = weight_files(target_dir)
    names = find_keys(files, cfg, target_dir=target_dir, overrides=keys)
    out: dict[str, Any] = {}
    for kind in only:
        with open_weights(files[names[kind]]) as f:
            out[kind] = f.get_tensor(names[kind]).float()
    vocab = int(cfg["vocab_size"])
    for kind in ("embed", "lm_head"):
        if kind in out and (out[kind].ndim != 2 or out[kind].shape[1] != int(cfg["hidden_size"])
                            or out[kind].shape[0] < vocab):
            raise ConfigError(f"run.target: tensor '{names[kind]}' has shape {tuple(out[kind].shape)}, expected "
                              f"[>= vocab_size {vocab}, hidden_size {cfg['hidden_size']}] (check run.target_keys.{kind})")
        if kind in out:
            out[kind] = out[kind][:vocab]  # some checkpoints pad the vocabulary rows
    if "norm" in out and tuple(out["norm"].shape) != (int(cfg["hidden_size"]),):
        raise ConfigError(f"run.target: tensor '{names['norm']}' has shape {tuple(out['norm'].shape)}, expected "
                          f"[{cfg['hidden_size']}] (check run.target_keys.norm)")
    if "norm" in out and str(cfg.get("model_type")) in ZERO_CENTRED_NORM:
        out["norm"] = out["norm"] + 1.0
    out["rms_norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    out["config"] = cfg
    out["keys"] = names
    log.debug("loaded %s from %s", names, target_dir)
    return out


def check_config(cfg: dict[str, Any], target_dir: str | Path) -> None:
    """The sizes and norm epsilon the trainer reads from the target's config: one line naming a bad one."""
    where = Path(target_dir) / "config.json"
    for key in ("vocab_size", "hidden_size"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"run.target: {where}: {key}: a positive integer, got {short(value)}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ConfigError(f"run.target: {where}: rms_norm_eps: a number in (0, 1), got {short(eps)}")


def torch_dtype_name(cfg: dict[str, Any]) -> str:
    """The target's dtype as a string ("float32", "bfloat16", ...)."""
    d = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return str(d).replace("torch.", "")


__all__ = ["find_keys", "load_target_tensors", "target_config", "torch_dtype_name"]
