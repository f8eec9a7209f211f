"""What an engine would refuse of a local target only once it starts (a traceback, a minute in, after
the stage made its outputs), checked before: :func:`check_engine_target` runs in
:func:`eaglenest.engine.make_llm` and where a server starts, :func:`check_max_model_len` where a stage's
command starts."""

from __future__ import annotations

import os
from pathlib import Path

from eaglenest.errors import ConfigError
from eaglenest.hf import check_generation_config, check_remote_code, load_config
from eaglenest.shapes import check_weight_shapes
from eaglenest.target import max_positions, read_config


def check_engine_target(model: str, max_model_len: int | None = None, *, trust_remote_code: bool = False,
                        key: str = "run.target", where: str = "engine") -> None:
    """What an engine would refuse of a local target only once it starts (a traceback, after the
    stage made its outputs), refused now in one line: no model, or one needing its own code
    (``key``: how the user gave it, ``run.target`` or a command's flag), a config.json transformers
    refuses (a string for a size), weights of other shapes than config.json makes, a
    generation_config.json transformers refuses, and ``<where>.max_model_len`` past its positions
    (``max_model_len`` None: not checked)."""
    check_remote_code(model, trust_remote_code=trust_remote_code, key=key)
    if (Path(model) / "config.json").is_file() and not read_config(model).keys() & SPECULATORS_KEYS:
        load_config(model, trust_remote_code=trust_remote_code, key=key)
    check_weight_shapes(model, key=key)  # vLLM would cut a larger tensor to config.json's shape without a word
    check_generation_config(model, key=key)
    if max_model_len is not None:
        check_max_model_len(model, max_model_len, where=where)


#: config.json keys of a speculators-format draft, which vLLM serves with the verifier it names.
SPECULATORS_KEYS = {"speculators_config", "speculators_model_type"}


def check_max_model_len(model: str, max_model_len: int, *, where: str = "engine") -> None:
    """Refuse a ``<where>.max_model_len`` past what vLLM derives from a local target's config.json
    (``target.max_positions``, rotary scaling counted), unless the user allowed it as vLLM lets them
    (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``); a hub id, or a config that does not tell, is left to vLLM."""
    path = Path(model) / "config.json"
    if not path.is_file() or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
        return
    found = max_positions(read_config(model))
    if found is not None and max_model_len > found[0]:
        raise ConfigError(f"{where}.max_model_len: {max_model_len} is more than {model} has positions for "
                          f"({found[1]}); set {where}.max_model_len={found[0]} or less")


__all__ = ["SPECULATORS_KEYS", "check_engine_target", "check_max_model_len"]
