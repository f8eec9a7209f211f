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

The speculators layout is written for the three families (``speculators_model_type`` eagle3, peagle,
dflash); vLLM 0.32 maps peagle to eagle3 with ``parallel_drafting`` and DFlash's
``sliding_window_non_causal`` to ``dflash_config.causal`` (negated, every layer).

The model card's snippets name the target quoted for the language they are in (:func:`python_literal`, a
POSIX shell's quoting, :func:`code_span` in prose), so a path holding quotes, backslashes or a newline reads
back as itself.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any, Literal

import torch

from eaglenest.config import printable
from eaglenest.errors import ConfigError

#: speculators release whose checkpoint layout ``format=speculators`` writes.
SPECULATORS_VERSION = "0.9.0"
#: Keys of the exported Llama config that form speculators' ``transformer_layer_config``.
LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id", "layer_types",
              "sliding_window")
#: Further keys of a DFlash export's config that go in its ``transformer_layer_config``.
DFLASH_LAYER_KEYS = ("num_hidden_layers", "rope_theta", "use_sliding_window")
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
    """speculators' config JSON for the vLLM-format config ``cfg``: its ``Eagle3SpeculatorConfig``,
    ``PEagleSpeculatorConfig`` for a P-EAGLE draft (``parallel_drafting``) or ``DFlashSpeculatorConfig``
    for a DFlash one (``dflash_config``)."""
    head = {"speculators_version": SPECULATORS_VERSION}
    if isinstance(cfg.get("dflash_config"), dict):
        return _dflash_config(cfg, head, _proposal("dflash", verifier, verifier_architectures, num_speculative_tokens))
    family = "peagle" if cfg.get("parallel_drafting") else "eagle3"
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        raise ConfigError("serve.format: speculators refuses norm_before_fc together with fc_norm "
                          "(its Eagle3SpeculatorConfig allows one); export this draft with serve.format=vllm")
    ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    layer = {k: cfg[k] for k in LAYER_KEYS if k in cfg}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, dtype=cfg["torch_dtype"])
    if len(ids) != 3:  # vLLM's llama_eagle3 sizes fc from this key (else 3); speculators from the ids
        layer["num_aux_hidden_states"] = len(ids)
    if family == "peagle":  # vLLM 0.32's peagle updater copies no fc_norm / norm_output from the top level:
        layer.update({flag: bool(cfg.get(flag, False)) for flag in FLAGS})  # its config starts from this dict
    out = {
        "architectures": ["PEagleSpeculator" if family == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": family,
        **head,
        "speculators_config": _proposal(family, verifier, verifier_architectures, num_speculative_tokens),
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": ids,
        # Every flag written: vLLM's defaults differ by family (norm_before_residual: eagle3 True, peagle False).
        **{flag: bool(cfg.get(flag, False)) for flag in FLAGS},
        "embed_requires_grad": False,
    }
    if family == "peagle":  # vLLM: speculators_model_type peagle -> eagle3 + parallel_drafting, this id -> pard_token
        out["mask_token_id"] = int(cfg["mask_token_id"])
    return out


def _proposal(algorithm: str, verifier: str, verifier_architectures: list[str], k: int) -> dict[str, Any]:
    """speculators' ``speculators_config``: greedy proposals of ``k`` tokens for the target ``verifier``."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}}


def _dflash_config(cfg: dict[str, Any], head: dict[str, Any], proposal: dict[str, Any]) -> dict[str, Any]:
    """``DFlashSpeculatorConfig`` JSON from the flat DFlash config ``cfg`` (serve/export.py).

    vLLM 0.32 rebuilds ``dflash_config`` from the top-level keys and sets ``causal`` to ``not
    sliding_window_non_causal`` for every layer (a missing key reads as non-causal there, but
    speculators' own default is False): the draft was trained non-causal inside the block, so the key
    is written true. No ``is_causal`` goes in ``transformer_layer_config`` (vLLM would read it first)."""
    dflash = cfg["dflash_config"]
    layer = {k: v for k, v in cfg.items() if k in LAYER_KEYS + DFLASH_LAYER_KEYS}
    layer.update(model_type="qwen3", tie_word_embeddings=False, dtype=cfg["torch_dtype"])
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        **head,
        "speculators_config": proposal,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg["target_hidden_size"],
        "block_size": int(cfg["block_size"]),
        # speculators' convention, as vLLM's: the ids the feature store captured (vLLM subtracts one).
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in dflash["target_layer_ids"]],
        "mask_token_id": int(dflash["mask_token_id"]),
        "sliding_window_non_causal": not dflash["causal"],
        "sample_from_anchor": False,
    }


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight names of speculators' ``Eagle3DraftModel``: the decoder block is ``layers.0``."""
    return {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): t for k, t in tensors.items()}


def flat_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The vLLM-format config of speculators' Eagle-3 / P-EAGLE config ``cfg`` (what
    :func:`speculators_config` made of it): ``transformer_layer_config`` lifted to the top level,
    ``parallel_drafting`` for ``speculators_model_type: peagle``. Any other config is returned as is."""
    layer = cfg.get("transformer_layer_config")
    if cfg.get("speculators_model_type") not in ("eagle3", "peagle") or not isinstance(layer, dict):
        return cfg
    flat = {**layer, **{k: v for k, v in cfg.items() if k != "transformer_layer_config"}}
    if cfg["speculators_model_type"] == "peagle":
        flat["parallel_drafting"] = True
    return flat


def flat_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`speculators_tensors`: ``layers.0.*`` back to the draft's ``midlayer.*``."""
    return {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): t for k, t in tensors.items()}


def convert_command(cfg: dict[str, Any], target: str) -> str:
    """The ``speculators convert`` line that keeps what the converter would otherwise drop (the target
    quoted for a POSIX shell: a path may hold spaces, quotes or a newline)."""
    kwargs = {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
              "norm_before_residual": bool(cfg.get("norm_before_residual"))}
    verifier = shlex.quote(str(target)) if _utf8(str(target)) else "<the target>"  # not UTF-8
    return (f"speculators convert <this directory> --algorithm eagle3 --verifier {verifier} "
            f"--algorithm-kwargs {shlex.quote(json.dumps(kwargs))}")


def _utf8(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (a path's byte that is not reads as a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def python_literal(text: str) -> str:
    """``text`` as a Python string literal a snippet can hold, any quote, backslash or newline escaped:
    double-quoted as the snippets' other strings (JSON's escapes are Python's), else Python's own repr
    (a character JSON leaves raw that a reader would not see, or cannot be written as UTF-8)."""
    literal = json.dumps(str(text), ensure_ascii=False)
    return literal if literal.isprintable() else repr(str(text))


def code_span(text: str) -> str:
    """``text`` as Markdown inline code on one line: a newline or another character that is not printable
    shown escaped (``\\n``; a path's byte that is not UTF-8, ``\\udcff``), the delimiter longer than any
    run of backticks in it."""
    text = printable(str(text))
    run = max((len(r) for r in re.findall(r"`+", text)), default=0)
    return f"`{text}`" if not run else f"{'`' * (run + 1)} {text} {'`' * (run + 1)}"


def revision_arg(revision: str) -> str:
    """The ``LLM(...)`` keyword reading the target at ``revision`` (``run.target_revision``); "" for none."""
    return f", revision={python_literal(revision)}" if revision else ""


def target_text(target: str, revision: str) -> str:
    """The target as the card's prose names it, with the hub revision it is read at."""
    return code_span(target) + (f" at revision {code_span(revision)}" if revision else "")


def fenced(code: str, lang: str) -> str:
    """A Markdown code block holding ``code`` as is: its fence is longer than any run of backticks in it."""
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", code)), default=0))
    return f"{fence}{lang}\n{code}\n{fence}"


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


def usage_text(fmt: Format, target: str, architecture: str, *, parallel: bool = False,
               num_speculative_tokens: int = 3, revision: str = "") -> str:
    """The card's opening: which format this is and how vLLM loads it (``parallel``: a P-EAGLE draft,
    served with ``parallel_drafting``; ``num_speculative_tokens``: the K its snippet serves, the
    draft's recommended one: a fixed 3 would be past the depth of a 2-slot or ttt_steps=2 draft;
    ``revision``: the hub revision the target is read at, "" for none)."""
    if fmt == "speculators":
        kind = "P-EAGLE (`speculators_model_type: peagle`)" if parallel else "Eagle-3"
        note = ("\n\nServed as trained with no flag to add: vLLM turns `speculators_model_type: peagle` into "
                "`method: eagle3` with `parallel_drafting: true` and takes `mask_token_id` as the parallel-drafting "
                "token (loading `mask_hidden`); served without `parallel_drafting` it would draft sequentially, "
                "which it was not trained for.") if parallel else ""
        return f"""Speculative-decoding draft for the target {target_text(target, revision)}, in speculators' {kind} \
checkpoint format (`speculators_config` names the target; vLLM serves it directly).

```python
from vllm import LLM
{speculators_llm(revision)}
```{note}"""
    spec = f'"num_speculative_tokens": {int(num_speculative_tokens)}'
    if parallel:
        spec += ', "parallel_drafting": True'
    note = ("\n\nA P-EAGLE draft: vLLM drafts all tokens of a round in one forward (`mask_token_id` and "
            "`mask_hidden` at depth >= 1); without `parallel_drafting` it would be served as a sequential "
            "EAGLE-3 draft, which it was not trained to be.") if parallel else ""
    return f"""Speculative-decoding draft for the target {target_text(target, revision)}, in vLLM's \
`{architecture}` format.

```python
from vllm import LLM
llm = LLM(model={python_literal(target)}{revision_arg(revision)},
          speculative_config={{"method": "eagle3", "model": "<this directory>", {spec}}})
```{note}"""


def speculators_llm(revision: str) -> str:
    """The line loading a speculators-format draft: vLLM reads the target from its config.json, at
    ``revision`` (``LLM``'s ``revision`` is the target's once vLLM has swapped the draft for it)."""
    if revision:
        return (f'llm = LLM(model="<this directory>"{revision_arg(revision)})  # the target (at this revision) and '
                "the number of draft tokens come from config.json")
    return 'llm = LLM(model="<this directory>")  # the target and the number of draft tokens come from config.json'


def _speculators_line(cfg: dict[str, Any], target: str) -> str:
    """How a vLLM-format export reaches speculators: its converter for an Eagle-3 draft; for a P-EAGLE
    one only ``serve.format=speculators`` (the converter's eagle3 algorithm drops ``mask_hidden`` and
    its output is served sequentially)."""
    if cfg.get("parallel_drafting"):
        return ("- speculators: export with `serve.format=speculators` (`speculators_model_type: peagle`); "
                "`speculators convert` has no P-EAGLE algorithm (its `--algorithm eagle3` drops `mask_hidden`, "
                "and vLLM would serve the result sequentially, which this draft was not trained for).")
    return ("- speculators: `speculators convert`, below (the converter reads the aux ids and "
            "`norm_before_residual` only from `--algorithm-kwargs`), or export with `serve.format=speculators`.")


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
                 _speculators_line(cfg, target)]
    lines += [f"- **{reader}**: {note}." for reader, note in notes]
    # The command in a block of its own: a quoted target may hold a newline or backticks, which a list
    # item's inline code would not keep.
    block = ("\n\n" + fenced(convert_command(cfg, target), "shell")
             if fmt == "vllm" and not cfg.get("parallel_drafting") else "")
    return "## Readers\n\n" + "\n".join(lines) + block
