"""The ``config.json`` a ``serve export`` writes for each family (serve/export.py says what is in it).

Pure functions of the checkpoint's ``draft_config`` and the target's config: no file is read here,
so every key can be tested without weights. The trade-off: the target's values the draft must share
(positions, special tokens) are copied, the draft's own shape and rotary come from the checkpoint.
"""

from __future__ import annotations

from typing import Any

from eaglenest.errors import ConfigError
from eaglenest.serve import formats
from eaglenest.target import max_positions

ARCHITECTURE = "LlamaForCausalLMEagle3"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
#: Keys copied verbatim from the target's (language) config.json. The rotary settings and the MLP's
#: activation are not among them: they come from the draft's own config, so vLLM serves the rotary
#: and activation the draft was trained with (a partial rotary included; train/model.py ``draft_rope``).
FROM_TARGET = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
               "attention_bias", "mlp_bias")
#: The one MLP activation vLLM's draft layers run (its Llama and Qwen3 MLPs refuse any other at engine start).
ACTIVATION = "silu"
FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


def draft_hf_config(info: dict[str, Any], target_cfg: dict[str, Any], *, dtype: str) -> dict[str, Any]:
    """The exported ``config.json`` from a checkpoint's info and the target's config."""
    d = info["draft_config"]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_key_value_heads"],
        "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        "num_hidden_layers": 1,
        "vocab_size": int(target_cfg["vocab_size"]),
        "draft_vocab_size": d["draft_vocab_size"],
        "target_hidden_size": d["target_hidden_size"],
        "rms_norm_eps": d["rms_norm_eps"],
        "hidden_act": d.get("hidden_act") or ACTIVATION,
        "tie_word_embeddings": False,
        **formats.aux_layer_keys(list(info["layer_ids"])),
        "torch_dtype": dtype,
    }
    _from_target(cfg, target_cfg, d, FROM_TARGET)
    for flag in FLAGS:
        cfg[flag] = bool(d.get(flag, False))
    if "sliding_attention" in (d.get("layer_types") or ()):  # train.sliding_window (vLLM's Llama reads both)
        cfg["layer_types"] = ["sliding_attention"]
        cfg["sliding_window"] = int(d["sliding_window"])
    if d.get("parallel_drafting"):  # train.family=peagle: vLLM feeds mask_token_id + mask_hidden at depth >= 1
        cfg["parallel_drafting"] = True  # read by eaglenest.engine.speculative_config (vLLM ignores it)
        cfg["mask_token_id"] = int(d["mask_token_id"])
    if cfg["hidden_size"] != target_cfg["hidden_size"]:
        raise ConfigError("draft hidden size differs from the target's: vLLM shares the target embeddings")
    return cfg


def dflash_hf_config(info: dict[str, Any], target_cfg: dict[str, Any], *, dtype: str) -> dict[str, Any]:
    """The exported ``config.json`` of a DFlash checkpoint (module docstring): every attention
    setting vLLM's ``qwen3_dflash`` resolves is written, none left to a default."""
    d = info["draft_config"]
    ids = sorted(int(i) for i in info["layer_ids"])
    if not ids or ids[0] < 1:
        raise ConfigError(f"serve export: a DFlash draft needs aux layers >= 1 (DFlash ids are id - 1), got {ids}")
    n = int(d["num_hidden_layers"])
    cfg: dict[str, Any] = {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_attention_heads": d["num_attention_heads"],
        "num_key_value_heads": d["num_key_value_heads"],
        "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        "num_hidden_layers": n,
        "vocab_size": int(target_cfg["vocab_size"]),
        "draft_vocab_size": d["draft_vocab_size"],
        "target_hidden_size": d["target_hidden_size"],
        "rms_norm_eps": d["rms_norm_eps"],
        "hidden_act": d.get("hidden_act") or ACTIVATION,
        "attention_bias": bool(d.get("attention_bias", False)),
        "tie_word_embeddings": False,
        "block_size": int(d["dflash_block_size"]),
        "dflash_config": {"mask_token_id": int(d["mask_token_id"]), "target_layer_ids": [i - 1 for i in ids],
                          "causal": False, "use_aux_hidden_state": True},
        # The attention the draft was trained with, explicit: full attention, non-causal in the block
        # (dflash_config.causal above; vLLM reads a top-level is_causal first, so none is written).
        "layer_types": ["full_attention"] * n,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": dtype,
    }
    _from_target(cfg, target_cfg, d, ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"))
    if cfg["hidden_size"] != target_cfg["hidden_size"]:
        raise ConfigError("draft hidden size differs from the target's: vLLM shares the target embeddings")
    return cfg



def _from_target(cfg: dict[str, Any], target_cfg: dict[str, Any], draft: dict[str, Any], keys) -> None:
    """``keys`` copied from the target's config, its length (:func:`_set_positions`), and the draft's own rotary
    settings, with ``rope_theta`` beside them for readers that predate ``rope_parameters`` (vLLM's
    qwen3_dflash defaults a missing theta to 1e6)."""
    for key in keys:
        if target_cfg.get(key) is not None:
            cfg[key] = target_cfg[key]
    _set_positions(cfg, target_cfg)
    rope = draft.get("rope_parameters") or {}
    cfg["rope_parameters"] = rope
    if rope.get("rope_theta") is not None:
        cfg["rope_theta"] = rope["rope_theta"]


def _set_positions(cfg: dict[str, Any], target_cfg: dict[str, Any]) -> None:
    """``max_position_embeddings`` of a target whose config.json leaves it to its class (Mistral's 131072):
    the value vLLM runs the target with, written out. Left out, the draft would get its own class's
    (Llama 2048, Qwen3 32768); vLLM raises an EAGLE-3 draft's to the target's length but not a DFlash
    draft's, whose rotary cache it sizes from it: a longer prompt would read past that cache. The rotary
    scaling is the draft's own (the target's, ``draft_rope``), so the unscaled length is the one written."""
    if "max_position_embeddings" in cfg:
        return
    found = max_positions({k: v for k, v in target_cfg.items() if k not in ("rope_parameters", "rope_scaling")})
    if found is not None:
        cfg["max_position_embeddings"] = found[0]
