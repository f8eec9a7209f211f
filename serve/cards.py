"""The model card (``README.md``) an export writes beside the draft: how to serve it (vLLM's or
speculators' format), its shape and rotary, and the run's record (steps, loss, per-step accuracy, the
training configuration). Pure text from the exported config.json and checkpoint.json: the card reads
every name (the architecture included) from the config it describes, so it never disagrees with it."""

from __future__ import annotations

import json
from typing import Any

from eaglenest.engine import RECOMMENDED_K
from eaglenest.serve import formats
from eaglenest.target import pinned_revision


def model_card(cfg: dict[str, Any], info: dict[str, Any], inputs: dict[str, Any], *,
               format: formats.Format = "vllm", notes: list[tuple[str, str]] = ()) -> str:
    m = info.get("metrics") or {}
    acc = ", ".join(f"{a:.3f}" for a in m.get("step_acc") or []) or "n/a"
    window = f"{cfg['sliding_window']} tokens" if "sliding_window" in cfg else "none (full attention)"
    family = "P-EAGLE (parallel drafting)" if cfg.get("parallel_drafting") else "EAGLE-3"
    train = info.get("train_config") or {}  # null reads as absent, as export's own checks read it
    steps = (f"P-EAGLE slots {(train.get('peagle') or {}).get('num_slots')}, mask token "
             f"{cfg.get('mask_token_id')}" if cfg.get("parallel_drafting")
             else f"TTT steps {train.get('ttt_steps')}")
    usage = formats.usage_text(format, inputs['target'], cfg['architectures'][0],
                               parallel=bool(cfg.get('parallel_drafting')),
                               num_speculative_tokens=cfg.get(RECOMMENDED_K, 3), revision=target_revision(inputs))
    return f"""# {family} draft head (eaglenest)

{usage}

| | |
|---|---|
| aux layers (vLLM ids) | {cfg['eagle_aux_hidden_state_layer_ids']} |
| draft vocab | {cfg['draft_vocab_size']} of {cfg['vocab_size']} target ids (coverage of loss tokens: {_number(info.get('vocab_coverage'), '.3f')}) |
| parameters | {_number(info.get('num_parameters'), ',')} (target embeddings shared, not counted) |
| hidden / heads / kv heads / head dim / MLP | {cfg['hidden_size']} / {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} / {cfg['intermediate_size']} |
| rotary | {_rope_text(cfg['rope_parameters'])} |
| EAGLE-3.1 flags | {', '.join(f for f in formats.FLAGS if cfg[f]) or 'none'} |
| dtype | {cfg['torch_dtype']}{' (linears: FP8 e4m3, per-channel scales, compressed-tensors)' if 'quantization_config' in cfg else ''} |
| trained steps | {info.get('step')} ({steps}) |
| speculative tokens when none is set | {cfg.get(RECOMMENDED_K, 'n/a')} (the family's best on the demo, docs/families.md) |
| sliding window | {window} |
| features | {_cell(inputs['store_uri'])} table {_cell(inputs['table'])} version {inputs['version']} |
| last logged loss | {_number(m.get('loss'), '.4f')} |
| last logged per-step top-1 accuracy | {acc} |

{_vocab_map_text(cfg)} Full provenance in `provenance.json`.

{formats.readers_text(cfg, format, notes, inputs['target'])}

Training configuration:

```json
{json.dumps(info.get('train_config', {}), indent=2, sort_keys=True)}
```
"""


def dflash_card(cfg: dict[str, Any], info: dict[str, Any], inputs: dict[str, Any], *,
                format: formats.Format = "vllm") -> str:
    m = info.get("metrics") or {}
    acc = ", ".join(f"{a:.3f}" for a in m.get("step_acc") or []) or "n/a"
    k = cfg.get(RECOMMENDED_K) or cfg["block_size"] - 1
    revision = target_revision(inputs)
    if format == "speculators":
        usage = f"""in speculators' DFlash checkpoint format
(`speculators_model_type: dflash`): {cfg['num_hidden_layers']} Qwen3-style layers over the target's hidden states, one
draft forward per round, non-causal attention inside the block. vLLM serves it directly; it serves the block
non-causal, as trained, because config.json says `sliding_window_non_causal: true` (vLLM sets
`dflash_config.causal` to its negation for every layer; with `false`, speculators' default, vLLM would serve
the block causal, which this draft was not trained for).

```python
from vllm import LLM
{formats.speculators_llm(revision)}
```"""
    else:
        usage = f"""in vLLM's flat DFlash format
(`{cfg['architectures'][0]}`): {cfg['num_hidden_layers']} Qwen3-style layers over the target's hidden states, one draft
forward per round, non-causal attention inside the block (`dflash_config.causal: false`).

```python
from vllm import LLM
llm = LLM(model={formats.python_literal(inputs['target'])}{formats.revision_arg(revision)},
          speculative_config={{"method": "dflash", "model": "<this directory>", "num_speculative_tokens": {k}}})
```"""
    return f"""# DFlash draft (eaglenest)

Speculative-decoding draft for the target {formats.target_text(inputs['target'], revision)}, {usage}

vLLM's V1 runner ignores `block_size` and drafts `num_speculative_tokens` mask slots; the draft was
trained for up to {cfg['block_size'] - 1}, and `serve` / `evaluate` use {k} when the recipe sets none
(`recommended_num_speculative_tokens`: the family's best on the demo, docs/families.md).

| | |
|---|---|
| target layers (`dflash_config.target_layer_ids`, 0-based; vLLM adds 1) | {cfg['dflash_config']['target_layer_ids']} |
| mask token id | {cfg['dflash_config']['mask_token_id']} |
| draft vocab | {cfg['draft_vocab_size']} of {cfg['vocab_size']} target ids (coverage of loss tokens: {_number(info.get('vocab_coverage'), '.3f')}) |
| parameters | {_number(info.get('num_parameters'), ',')} (target embeddings shared, not counted) |
| layers / hidden / heads / kv heads / head dim / MLP | {cfg['num_hidden_layers']} / {cfg['hidden_size']} / {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} / {cfg['intermediate_size']} |
| rotary | {_rope_text(cfg['rope_parameters'])} |
| dtype | {cfg['torch_dtype']} |
| trained steps | {info.get('step')} (block size {cfg['block_size']}) |
| features | {_cell(inputs['store_uri'])} table {_cell(inputs['table'])} version {inputs['version']} |
| last logged loss | {_number(m.get('loss'), '.4f')} |
| last logged per-slot top-1 accuracy | {acc} |

{_vocab_map_text(cfg)} Full provenance in `provenance.json`.

Training configuration:

```json
{json.dumps(info.get('train_config', {}), indent=2, sort_keys=True)}
```
"""


def target_revision(inputs: dict[str, Any]) -> str:
    """The hub revision the export read its target at, which the card's snippets name (else a reader loads
    ``main``): ``run.target_revision`` as pinned in this process, else the ``target_revision`` the feature
    identity records for that same hub id (the revision its features were captured at, which export checked
    the target is at). "" for a local folder, or an identity that records none."""
    target = str(inputs.get("target") or "")
    if revision := pinned_revision(target):
        return revision
    try:
        comps = json.loads(inputs.get("feature_identity") or "{}")
    except (TypeError, ValueError):
        return ""
    if not isinstance(comps, dict) or comps.get("target") != target:
        return ""
    revision = comps.get("target_revision")
    return revision if isinstance(revision, str) else ""


def _vocab_map_text(cfg: dict[str, Any]) -> str:
    """What maps draft ids to target ids: ``d2t`` offsets, or nothing for a whole-vocabulary draft (export
    writes no ``d2t`` / ``t2d`` then: vLLM's draft models have no map to load them into)."""
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:
        return "The draft's vocabulary is the target's whole vocabulary (draft id = target id): no `d2t` / `t2d`."
    return "`d2t` holds offsets: `target_id = draft_id + d2t[draft_id]`."


def _cell(text: Any) -> str:
    """``text`` as inline code in a table cell: a ``|`` in it (a store path may hold one) escaped, which would
    otherwise end the cell."""
    return formats.code_span(str(text)).replace("|", "\\|")


def _number(x: Any, spec: str) -> str:
    """``x`` formatted, or n/a: checkpoint.json writes a loss or coverage that was NaN or infinite as null."""
    return "n/a" if x is None else format(x, spec)


def _rope_text(rope: dict[str, Any]) -> str:
    text = f"{rope.get('rope_type', 'default')}, theta {rope.get('rope_theta')}"
    if rope.get("partial_rotary_factor"):
        text += f", partial {rope['partial_rotary_factor']} of each head"
    return text
