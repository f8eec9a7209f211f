"""What ``evaluate al`` will decode, settled before an engine starts: the prompt set, the engine's
``max_model_len`` (raised to fit the longest context bucket) and the buckets' held-out material.

Everything that would otherwise fail only once an engine runs, after the groups before it were
decoded (vLLM refusing a prompt with no room for output, a bucket too short for its material,
``chat`` material with no held-out chats), is refused here in one line. Trade-off: every chat
prompt is rendered once more with the target's tokenizer (cheap next to an engine start), and
``recall`` prompts are checked with generated middle turns, as the held-out answers are not
decoded yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from eaglenest.engine import EngineConfig
from eaglenest.evaluate.buckets import bucket_lengths, check_generated, material_pool
from eaglenest.evaluate.prompts import check_prompt_lengths, load_prompt_set
from eaglenest.hf import load_config, load_tokenizer
from eaglenest.precheck import check_max_model_len
from eaglenest.serve.target_check import check_served_tokenization
from eaglenest.target import local_dir, read_config
from eaglenest.target import max_positions as vllm_positions


def max_positions(target: str, *, trust_remote_code: bool = False) -> int:
    """The target's positions as vLLM derives them from a local config.json (``target.max_positions``:
    a linear or dynamic rotary factor counted), else its language config's ``max_position_embeddings``
    (a multimodal wrapper's ``text_config``, Gemma-3 or Mistral-3 style); 4096 when it does not say."""
    cfg = load_config(target, trust_remote_code=trust_remote_code)
    derived = vllm_positions(read_config(target)) if (local_dir(target) / "config.json").is_file() else None
    if derived is not None:
        return derived[0]
    return int(getattr(cfg.get_text_config(), "max_position_embeddings", 4096))


class Plan(NamedTuple):
    """What ``evaluate_al`` decodes, and with which engine, once every check that can refuse it passed."""

    groups: dict[str, list[dict]]
    prompt_info: dict
    tok: Any
    max_positions: int
    engine: EngineConfig
    #: Held-out prompts whose answers fill the context buckets (``buckets.material_pool``).
    pool: list[dict]


def plan(cfg, *, target: str, store_uri: str, trust_remote_code: bool = False, draft: str | None = None) -> Plan:
    """The prompt set, the engine (``max_model_len`` raised to fit the longest bucket) and the buckets'
    material, refusing (ConfigError, one line) whatever would fail only once an engine runs: a bucket
    without room or too short for its material, chat material without held-out chats, a prompt with
    no room for output. ``evaluate_al`` calls it before its engine starts, the served-AL selection
    before training starts. ``draft``: the export served, whose features' tokenizer and chat template
    ``target``'s are compared with (one warning line if they differ: the AL of token ids it never saw)."""
    if draft:
        check_served_tokenization(draft, target, off_policy=False, stage="measuring")
    groups, prompt_info = load_prompt_set(cfg, store_uri)
    max_pos = max_positions(target, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(target, trust_remote_code=trust_remote_code)
    lengths = bucket_lengths(cfg.context_buckets, max_positions=max_pos, max_tokens=cfg.bucket_max_tokens)
    base = cfg.engine.max_model_len
    if base == EngineConfig.max_model_len and base > max_pos:  # the default on a target of fewer positions: its own
        base = max_pos
    max_len = max(base, min(max_pos, max(lengths.values(), default=0) + cfg.bucket_max_tokens))
    check_max_model_len(target, max_len, where="evaluate.engine")  # a user's value past max_pos: before any engine
    engine = dataclasses.replace(cfg.engine, max_model_len=max_len)
    check_generated(tok, lengths, kinds=tuple(cfg.bucket_material), per_bucket=cfg.bucket_prompts, seed=cfg.engine.seed,
                    chat_template_kwargs=cfg.chat_template_kwargs)
    pool = material_pool(cfg, store_uri, groups) if lengths else []
    chats = {p["sample_id"]: p for p in [*(p for ps in groups.values() for p in ps), *pool]}
    check_prompt_lengths(tok, list(chats.values()), cfg.chat_template_kwargs, max_len=max_len, max_positions=max_pos)
    return Plan(groups, prompt_info, tok, max_pos, engine, pool)
