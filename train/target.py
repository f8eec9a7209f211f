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

Some heads scale their logits after lm_head (:data:`LOGIT_SCALES`: Granite divides them by
``logits_scaling``, Cohere2-MoE multiplies them by ``logit_scale``, MiniCPM divides the normed hidden
states by ``hidden_size / dim_model_base``), as transformers' ``*ForCausalLM`` and vLLM's logits
processor do. A scalar on the logits is a scalar on lm_head's rows, so the lm_head returned here carries
it: the trainer's target distribution then has the target's own temperature. A scale or a cap this
module does not model (a soft cap, a LayerNorm final norm, such a key on another model type) is
refused in one line rather than trained against the wrong distribution.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.target import (ZERO_CENTRED_NORM, language_config, local_dir, open_weights, read_config,
                              weight_files)

log = logging.getLogger(__name__)

#: Tensor names of a plain causal LM (Llama, Qwen, Mistral, DeepSeek, gpt-oss, MiniMax ...).
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
#: Name parts of non-language towers: never the draft's embeddings, norm or head.
_TOWERS = re.compile(r"(^|\.)(vision|visual|vision_tower|vision_model|audio|audio_tower|multi_modal_projector|"
                     r"mm_projector|image_newline|mtp)(\.|_|$)")
_EMBED_SUFFIXES = ("embed_tokens.weight", "tok_embeddings.weight", "word_embeddings.weight")
#: Model types whose logits are lm_head(norm(h)) times a scalar from their config: (the config key, its value
#: when config.json has none (the transformers config class's default), "multiply" or "divide" the logits by it).
LOGIT_SCALES = {
    **{t: ("logits_scaling", 1.0, "divide") for t in ("granite", "granite_swa", "granitemoe", "granitemoe_swa",
                                                      "granitemoeshared", "granitemoehybrid")},
    "cohere2_moe": ("logit_scale", 0.0625, "multiply"),
    "hyperclovax": ("logits_scaling", 1.0, "multiply"),  # muP: multiplied, whatever Granite's same key does
    "falcon_h1": ("lm_head_multiplier", 1.0, "multiply"),
}
#: MiniCPM divides the normed hidden states by hidden_size / dim_model_base (vLLM's ``scale_width``); MiniCPM3's
#: config class defaults dim_model_base to 256, MiniCPM's own (remote code) config is read as it stands.
MINICPM = {"minicpm": None, "minicpm3": 256}
#: Config keys that scale or cap logits in some model type: on a model type this module does not know to apply
#: them (a Llama with logit_scale: vLLM multiplies by it, transformers does not) they are refused.
SCALE_KEYS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "dim_model_base", "output_multiplier",
              "output_mult", "logits_mup_width_multiplier", "final_logit_softcapping")
#: Model types whose final norm is a LayerNorm (mean-centred), which the trainer's RMSNorm head does not model.
LAYER_NORM_HEAD = ("cohere", "cohere2")


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
    scale = logit_scale(cfg, target_dir) if "lm_head" in only else 1.0
    check_config(cfg, target_dir)
    files = weight_files(target_dir)
    names = find_keys(files, cfg, target_dir=target_dir, overrides=keys)
    bias = names["norm"].removesuffix(".weight") + ".bias"
    if "norm" in only and bias != names["norm"] and bias in files:  # StableLM, OPT, Pythia, Phi-2, Falcon
        raise ConfigError(f"run.target: {target_dir}'s final norm '{names['norm']}' has a bias ('{bias}'): a LayerNorm "
                          "(mean-centred), which the trainer's RMSNorm target head does not model (docs/targets.md)")
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
    if "lm_head" in out and scale != 1.0:  # a new tensor: a tied embedding read beside it keeps its values
        out["lm_head"] = out["lm_head"] * scale
        log.info("target logits scaled by %g (model type %s)", scale, cfg.get("model_type"))
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


def logit_scale(cfg: dict[str, Any], target_dir: str | Path) -> float:
    """The scalar the target multiplies lm_head(norm(h)) by (see :data:`LOGIT_SCALES`); 1.0 for a plain head.
    A head this module does not model is refused in one line naming the model type and the key."""
    kind, where = str(cfg.get("model_type", "")), Path(target_dir) / "config.json"

    def number(key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"run.target: {where}: {key}: a number > 0, got {short(value)}")
        return float(value)

    if kind in LAYER_NORM_HEAD or kind == "cohere2_moe" and cfg.get("rms_norm_eps") is None:
        raise ConfigError(f"run.target: {target_dir} is a {kind} model whose final norm is a LayerNorm (mean-centred) "
                          "and whose logits are scaled by logit_scale, which the trainer's target head does not "
                          "model (nor does vLLM serve it as an EAGLE-3 target; docs/targets.md)")
    if cfg.get("final_logit_softcapping") is not None:
        raise ConfigError(f"run.target: {target_dir} ({kind or 'no model_type'}) soft-caps its logits "
                          f"(final_logit_softcapping={short(cfg['final_logit_softcapping'])}), which the trainer's "
                          "target head does not model (docs/targets.md)")
    if kind in MINICPM:
        base = cfg.get("dim_model_base", MINICPM[kind])
        return 1.0 if base is None else number("dim_model_base", base) / number("hidden_size", cfg.get("hidden_size"))
    if kind in LOGIT_SCALES:
        key, default, how = LOGIT_SCALES[kind]
        value = number(key, cfg.get(key, default))
        return value if how == "multiply" else 1.0 / value
    for key in SCALE_KEYS:
        value = cfg.get(key)
        neutral = (None, 1, cfg.get("hidden_size")) if key == "dim_model_base" else (None, 1)
        if value not in neutral or isinstance(value, bool):
            raise ConfigError(f"run.target: {target_dir} ({kind or 'no model_type'}) sets {key}={short(value)}, a "
                              "scale of its logits the trainer's target head does not apply for this model type "
                              "(docs/targets.md)")
    return 1.0


def torch_dtype_name(cfg: dict[str, Any]) -> str:
    """The target's dtype as a string ("float32", "bfloat16", ...)."""
    d = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return str(d).replace("torch.", "")


__all__ = ["find_keys", "load_target_tensors", "logit_scale", "target_config", "torch_dtype_name"]
