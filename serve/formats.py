"""Where an exported draft travels: the aux-layer keys each reader uses, speculators' own layout, and
what each reader cannot represent.

Two readers are checked here (vLLM's by running its code, speculators' by its layout), and they
agree on the weights but not on the config:

* vLLM 0.32 takes the aux layer ids from the top-level ``eagle_aux_hidden_state_layer_ids``
  (``v1/worker/gpu_model_runner.py`` ``_get_eagle3_aux_layers_from_config``; the nested
  ``eagle_config`` list only when the top-level one is missing, and in ``llama_eagle3.py`` only
  for its length) and gives the layer a window from ``layer_types`` + ``sliding_window``.
* speculators reads its own layout (``speculators_config`` + ``transformer_layer_config``, weights
  ``layers.0.*``); ``speculators convert --algorithm eagle3`` builds that layout from a
  ``LlamaForCausalLMEagle3`` directory but takes the aux ids and ``norm_before_residual`` only from
  ``--algorithm-kwargs`` and keeps neither the window nor rope scaling.

So the vLLM-format export writes the ids twice: top level in vLLM's convention (the ids the feature
store captured), nested in ``eagle_config`` in the "output of block k" convention (each id minus
one; vLLM reads only that list's length, for ``fc``'s width). No other reader of the nested list
(SGLang's, for one) is run or claimed here: ``import sglang`` (0.5.14) needs triton and torchvision
at its top, which the CPU environment this is tested on cannot have (docs/serve.md). What a checked
reader cannot represent is returned by :func:`reader_notes` and goes to the log and the model card.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import torch

from eaglenest.errors import ConfigError

#: speculators release whose checkpoint layout ``format=speculators`` writes.
SPECULATORS_VERSION = "0.9.0"
#: Keys of the exported Llama config that form speculators' ``transformer_layer_config``.
LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id", "layer_types",
              "sliding_window")
FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
Format = Literal["vllm", "speculators"]


def aux_layer_keys(layer_ids: list[int]) -> dict[str, Any]:
    """The config keys naming the aux layers: vLLM/speculators ids at the top level, the same layers
    as "output of block k" (id - 1) nested in ``eagle_config`` (whose length vLLM reads for ``fc``)."""
    ids = [int(i) for i in layer_ids]
    return {"eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids], "use_aux_hidden_state": True}}


def speculators_config(cfg: dict[str, Any], *, verifier: str, verifier_architectures: list[str],
                       num_speculative_tokens: int) -> dict[str, Any]:
    """speculators' ``Eagle3SpeculatorConfig`` JSON for the vLLM-format config ``cfg``."""
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        raise ConfigError("serve.format: speculators refuses norm_before_fc together with fc_norm "
                          "(its Eagle3SpeculatorConfig allows one); export this draft with serve.format=vllm")
    ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    layer = {k: cfg[k] for k in LAYER_KEYS if k in cfg}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, dtype=cfg["torch_dtype"])
    if len(ids) != 3:  # vLLM's llama_eagle3 sizes fc from this key (else 3); speculators from the ids
        layer["num_aux_hidden_states"] = len(ids)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": ids,
        **{flag: bool(cfg.get(flag, False)) for flag in FLAGS},
        "embed_requires_grad": False,
    }


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight names of speculators' ``Eagle3DraftModel``: the decoder block is ``layers.0``."""
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): t for k, t in tensors.items()}


def convert_command(cfg: dict[str, Any], target: str) -> str:
    """The ``speculators convert`` line that keeps what the converter would otherwise drop."""
    kwargs = {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
              "norm_before_residual": bool(cfg.get("norm_before_residual"))}
    return (f"speculators convert <this directory> --algorithm eagle3 --verifier {target} "
            f"--algorithm-kwargs '{json.dumps(kwargs)}'")


def reader_notes(cfg: dict[str, Any], fmt: Format, *, target_layers: int) -> list[tuple[str, str]]:
    """(reader, what it loses) for each checked reader that cannot represent part of this draft
    (``target_layers``: kept for callers; no checked reader limits which layers may be aux layers)."""
    del target_layers
    window = "sliding_attention" in (cfg.get("layer_types") or ())
    rope = cfg.get("rope_parameters") or {}
    notes: list[tuple[str, str]] = []
    if fmt == "speculators":
        return notes
    if window:
        notes.append(("speculators convert", "drops layer_types/sliding_window: the converted draft attends "
                                             "over the whole context; export with serve.format=speculators instead"))
    if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor"):
        notes.append(("speculators convert", "keeps only rope_theta (not rope_type/scaling/partial rotary): "
                                             "export with serve.format=speculators instead"))
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        notes.append(("speculators convert", "refuses norm_before_fc together with fc_norm"))
    return notes


def usage_text(fmt: Format, target: str, architecture: str, *, parallel: bool = False) -> str:
    """The card's opening: which format this is and how vLLM loads it (``parallel``: a P-EAGLE draft,
    served with ``parallel_drafting``)."""
    if fmt == "speculators":
        return f"""Speculative-decoding draft for the target `{target}`, in speculators' Eagle-3 checkpoint format
(`speculators_config` names the target; vLLM serves it directly).

```python
from vllm import LLM
llm = LLM(model="<this directory>")  # the target and the number of draft tokens come from config.json
```"""
    pd = ', "parallel_drafting": True' if parallel else ""
    note = ("\n\nA P-EAGLE draft: vLLM drafts all tokens of a round in one forward (`mask_token_id` and "
            "`mask_hidden` at depth >= 1); without `parallel_drafting` it would be served as a sequential "
            "EAGLE-3 draft, which it was not trained to be.") if parallel else ""
    return f"""Speculative-decoding draft for the target `{target}`, in vLLM's `{architecture}` format.

```python
from vllm import LLM
llm = LLM(model="{target}",
          speculative_config={{"method": "eagle3", "model": "<this directory>", "num_speculative_tokens": 3{pd}}})
```{note}"""


def readers_text(cfg: dict[str, Any], fmt: Format, notes: list[tuple[str, str]], target: str) -> str:
    """The card's "Readers" section: where each reader finds the aux layers, and what it loses."""
    ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    if fmt == "speculators":
        lines = [f"- vLLM and speculators: `eagle_aux_hidden_state_layer_ids` {ids}; the window and rotary "
                 "settings travel in `transformer_layer_config`."]
    else:
        lines = [f"- vLLM: top-level `eagle_aux_hidden_state_layer_ids` {ids}; `layer_types` + `sliding_window` "
                 "for the window.",
                 f"- `eagle_config.eagle_aux_hidden_state_layer_ids` {[i - 1 for i in ids]}: the same layers as "
                 "\"output of block k\" (id - 1); vLLM reads only its length. Other readers (SGLang) are not tested.",
                 f"- speculators: `{convert_command(cfg, target)}` (the converter reads the aux ids and "
                 "`norm_before_residual` only from `--algorithm-kwargs`), or export with `serve.format=speculators`."]
    lines += [f"- **{reader}**: {note}." for reader, note in notes]
    return "## Readers\n\n" + "\n".join(lines)
