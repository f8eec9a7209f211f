"""Export a trained draft checkpoint as a vLLM-loadable ``LlamaForCausalLMEagle3`` directory.

The one boundary between eaglenest's training module and the serving format. Output:

* ``config.json``: a one-layer Llama config (``architectures: ["LlamaForCausalLMEagle3"]``) with
  the target's shape, rope settings and max_position_embeddings, ``vocab_size`` = target vocab,
  ``draft_vocab_size``, ``target_hidden_size``, the aux layer ids (top-level
  ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention, ``eagle_config``'s as id - 1: see
  ``serve/formats.py``), ``use_aux_hidden_state``, the EAGLE-3.1 flags and ``torch_dtype``.
* ``model.safetensors``: ``fc.weight`` (+ ``input_norm.weight`` / ``fc_norm.{i}.weight`` when the
  3.1 flags are on), ``midlayer.*`` in HF Llama names, ``norm.weight``, ``lm_head.weight``,
  ``d2t`` (int64 offsets: target = draft + d2t[draft]) and ``t2d`` (bool; vLLM skips it), both left
  out for a draft of the target's whole vocabulary (vLLM refuses a map there). No ``embed_tokens``.
* ``README.md`` (the model card, ``serve/cards.py``) and ``provenance.json``.

A P-EAGLE draft (``train.family=peagle``, eaglenest.train.peagle) is the same format plus
``mask_token_id`` and ``parallel_drafting: true`` in config.json and the ``mask_hidden`` tensor
[n_aux*H] in the weights; vLLM loads ``mask_hidden`` only when served with ``parallel_drafting``,
which :func:`eaglenest.engine.speculative_config` adds from that config key.

A DFlash draft (``train.family=dflash``, eaglenest.train.dflash) is exported in vLLM's flat DFlash
format instead (:func:`dflash_hf_config`): ``architectures: ["DFlashDraftModel"]``, ``model_type:
qwen3`` with an explicit ``head_dim``, ``num_hidden_layers`` = the draft's layers,
``target_hidden_size``, ``block_size``, ``dflash_config`` {``mask_token_id``, ``target_layer_ids``
(the aux ids minus one: vLLM adds one), ``causal: false``} and the attention written out
(``layer_types`` all ``full_attention``, ``use_sliding_window: false``), so
vLLM serves the non-causal block attention the draft was trained with whatever its defaults; weights
``layers.N.*``, ``fc.weight`` [H, n_aux*H], ``hidden_norm``, ``norm``, ``lm_head``, ``d2t``, ``t2d``
(the draft's own names). :func:`eaglenest.engine.speculative_config` gives ``{"method": "dflash"}``
for it.

With ``serve.format=speculators`` the same weights are written in speculators' own layout
(``speculators_config`` + ``transformer_layer_config``; ``serve/formats.py``): Eagle-3 or P-EAGLE
(``layers.0.*``) or DFlash (the flat names), which vLLM also serves directly, as trained (a DFlash
config says ``sliding_window_non_causal: true``, without which vLLM serves the block causal).

With ``serve.quantization=fp8`` the draft's linears (``fc``, midlayer q/k/v/o, gate/up/down) are
written as float8_e4m3fn ``weight`` + float32 per-output-channel ``weight_scale`` and config.json gets
compressed-tensors' ``quantization_config`` (``serve/fp8.py`` says why this format and why
``lm_head`` stays at the export dtype).

vLLM renames ``midlayer.`` to ``layers.0.``, stacks q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, and loads ``d2t`` into ``draft_id_to_target_id`` (tests/serve checks this
against vLLM's own mapper). Floating weights are cast to the export dtype; maps stay integer/bool.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import LlamaConfig

from eaglenest.config import short
from eaglenest.engine import RECOMMENDED_K, TRAINED_K
from eaglenest.errors import ConfigError, StoreError
from eaglenest.paths import install_dir, make_dir, orphans, pid_prefix, shown_path, umask, user_path
from eaglenest.provenance import write_json_atomic, write_provenance
from eaglenest.serve import formats, fp8
from eaglenest.serve.cards import dflash_card, model_card
from eaglenest.serve.draft_files import vocab_map_error, whole_vocab_error
from eaglenest.serve.run_check import check_finished
from eaglenest.serve.target_check import check_target_weights, check_tokenization
from eaglenest.target import read_config
from eaglenest.train.checkpoint import INFO, WEIGHTS, read_info
from eaglenest.train.dflash import DFlashDraft, is_dflash
from eaglenest.train.model import Eagle3Draft
from eaglenest.train.config import recommended_num_speculative_tokens, trained_num_speculative_tokens
from eaglenest.train.target import target_config, torch_dtype_name

log = logging.getLogger(__name__)

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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: What an export writes, and all it writes: a folder holding only these (config.json and
#: provenance.json among them, in the shapes export writes) is an earlier export, the one kind of
#: folder ``serve export`` replaces. Any other non-empty folder is refused, never deleted.
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "README.md", "provenance.json"})
#: provenance.json's ``stage`` in an export (exports made before it are recognised by their shape).
STAGE = "serve export"
#: draft_config keys the exported config.json needs (DFlash: also DFLASH_KEYS).
DRAFT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "draft_vocab_size", "target_hidden_size", "rms_norm_eps")
DFLASH_KEYS = ("num_hidden_layers", "dflash_block_size", "mask_token_id")


def is_export(path: str | Path) -> bool:
    """Whether the directory ``path`` holds an earlier ``serve export`` and nothing else."""
    p = Path(path)
    try:
        names = {c.name for c in p.iterdir()}
        if not names <= EXPORT_FILES or not {"config.json", "provenance.json"} <= names:
            return False
        cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
        prov = json.loads((p / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict) or not isinstance(prov, dict) or not isinstance(cfg.get("architectures"), list):
        return False
    inputs = prov.get("inputs")
    return prov.get("stage") == STAGE or (prov.get("format") in ("vllm", "speculators")
                                          and isinstance(inputs, dict) and "checkpoint" in inputs)


def check_out(out_dir: str | Path, ckpt_dir: str | Path, *, key: str = "--out",
              keep_clear: tuple[tuple[str, str | Path], ...] = (), not_at: tuple[tuple[str, str | Path], ...] = ()
              ) -> Path:
    """Refuse (``key``, one line) an output folder export must not replace: a file, a non-empty folder
    that is not an earlier export, a folder equal to, inside or holding the checkpoint (or a
    ``keep_clear`` (name, path) such as the store), or equal to / holding a ``not_at`` one (the
    workdir). Returns ``out_dir`` resolved."""
    out = user_path(out_dir, key, error=ConfigError)
    for name, other, inside_ok in ([("the checkpoint", ckpt_dir, False)] + [(n, p, False) for n, p in keep_clear]
                                   + [(n, p, True) for n, p in not_at]):
        o = Path(other).resolve()
        if out == o or out in o.parents or (o in out.parents and not inside_ok):
            raise ConfigError(f"{key}: {shown_path(out_dir)} would overwrite {name} ({shown_path(o)}); "
                              "choose an empty or new folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: {shown_path(out_dir)} is a file, not a directory")
    try:
        filled = out.is_dir() and any(out.iterdir())
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {shown_path(out_dir)} ({exc.strerror})") from None
    if filled and not is_export(out):
        raise ConfigError(f"{key}: {shown_path(out_dir)} holds files that are not an exported draft; "
                          "choose an empty or new folder")
    return out


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
    for key in FROM_TARGET:
        if target_cfg.get(key) is not None:
            cfg[key] = target_cfg[key]
    rope = d.get("rope_parameters") or {}
    cfg["rope_parameters"] = rope
    if rope.get("rope_theta") is not None:
        cfg["rope_theta"] = rope["rope_theta"]  # readers that predate rope_parameters
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
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if target_cfg.get(key) is not None:
            cfg[key] = target_cfg[key]
    rope = d.get("rope_parameters") or {}
    cfg["rope_parameters"] = rope
    if rope.get("rope_theta") is not None:
        cfg["rope_theta"] = rope["rope_theta"]  # vLLM's qwen3_dflash defaults a missing theta to 1e6
    if cfg["hidden_size"] != target_cfg["hidden_size"]:
        raise ConfigError("draft hidden size differs from the target's: vLLM shares the target embeddings")
    return cfg


def export_draft(ckpt_dir: str | Path, out_dir: str | Path, *, target_dir: str | Path,
                 dtype: str = "auto", quantization: str = "none", format: formats.Format = "vllm",
                 num_speculative_tokens: int | None = None, argv: list[str] | None = None,
                 recipe: dict[str, Any] | None = None, key: str = "--out",
                 keep_clear: tuple[tuple[str, str | Path], ...] = (),
                 not_at: tuple[tuple[str, str | Path], ...] = (), family: str | None = None,
                 off_policy: bool = False) -> Path:
    """Write the draft directory ``out_dir`` (``format``: vLLM's or speculators' layout) from
    checkpoint ``ckpt_dir``; returns out_dir. ``num_speculative_tokens`` (None: the family's measured
    best, :func:`recommended_num_speculative_tokens`) is recorded as the draft's default K.
    ``family`` (the recipe's ``train.family``; None: not checked) must be the checkpoint's draft's.
    ``target_dir`` must hold the weights, tokenizer and chat template the draft was trained with
    (``serve/target_check.py``; ``off_policy``: ``run.off_policy``, a warning instead).
    ``out_dir`` must be new, empty or an earlier export (:func:`check_out`, ``key`` names it in the
    error); the new export is written beside it and renamed into place, the old one removed last."""
    from safetensors.torch import save_file

    shown = Path(out_dir)
    # Written where the folder really is: a symlinked --out keeps its link, pointing at the new export.
    out_dir = check_out(out_dir, ckpt_dir, key=key, keep_clear=keep_clear, not_at=not_at)
    if is_export(ckpt_dir):  # serve export's own output (weights renamed, cast, quantised), no checkpoint.json
        came = json.loads((Path(ckpt_dir) / "provenance.json").read_text(encoding="utf-8")).get("inputs")
        came = came.get("checkpoint") if isinstance(came, dict) else None
        raise ConfigError(f"serve.checkpoint_subdir: {shown_path(ckpt_dir)} holds an exported draft, not a training "
                          f"checkpoint; export the checkpoint it came from ({short(came, 200)})")
    check_finished(ckpt_dir)  # a run killed (or still running) there: its checkpoint.json is none, or an earlier run's
    info = read_info(ckpt_dir)
    _check_info(info, Path(ckpt_dir) / INFO)
    trained_as = checkpoint_family(info["draft_config"])
    if family is not None and family != trained_as:  # the recipe says another draft than the one trained
        raise ConfigError(f"train.family={family}: {shown_path(Path(ckpt_dir) / INFO)} holds a {trained_as} draft; "
                          f"export it with train.family={trained_as}, or train a {family} draft first (`train run` "
                          f"with train.family={family})")
    target_cfg = target_config(target_dir)
    _check_target(info, target_cfg, target=Path(target_dir), ckpt=Path(ckpt_dir) / INFO)
    check_target_weights(info, str(target_dir), ckpt=Path(ckpt_dir) / INFO, off_policy=off_policy)
    check_tokenization(info, str(target_dir), ckpt=Path(ckpt_dir) / INFO, off_policy=off_policy)
    if dtype == "auto":
        dtype = torch_dtype_name(target_cfg)
    if dtype not in DTYPES:
        raise ConfigError(f"serve.dtype: cannot export as {dtype!r} (one of {', '.join(DTYPES)})")
    if quantization not in ("none", "fp8"):
        raise ConfigError(f"serve.quantization: one of none, fp8; got {quantization!r}")
    if format not in ("vllm", "speculators") or (format == "speculators" and quantization != "none"):
        raise ConfigError(f"serve.format: vllm, or speculators without quantization; got {format!r}")
    dflash = bool(info["draft_config"].get("dflash"))
    if dflash and quantization != "none":
        raise ConfigError("serve.quantization: a DFlash draft (train.family=dflash) exports with "
                          "serve.quantization=none only for now")
    try:
        cfg = (dflash_hf_config if dflash else draft_hf_config)(info, target_cfg, dtype=dtype)
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{shown_path(Path(ckpt_dir) / INFO)}: draft_config: bad or missing "
                         f"{exc.args[0] if isinstance(exc, KeyError) else 'value'} ({type(exc).__name__}); "
                         "the checkpoint is damaged: train again (`train run`)") from None
    k = num_speculative_tokens or _recommended_k(info, Path(ckpt_dir) / INFO)
    if format == "vllm" or dflash:  # (a speculators config carries k in its proposal; the DFlash card reads it here)
        cfg[RECOMMENDED_K] = k  # serve / evaluate use it when their num_speculative_tokens is null
    trained = _recommended_k(info, Path(ckpt_dir) / INFO, read=trained_num_speculative_tokens)
    if k > trained:
        log.warning("serve.num_speculative_tokens %d is past the %d tokens a round this draft was trained to "
                    "draft: the proposals past %d come from positions it never learnt", k, trained, trained)
    written = cfg
    if format == "speculators":
        written = formats.speculators_config(cfg, verifier=str(target_dir),
                                             # the model vLLM serves: a multimodal wrapper's, not its text config's
                                             verifier_architectures=read_config(target_dir).get("architectures") or [],
                                             num_speculative_tokens=k)
    written[TRAINED_K] = trained  # engine.speculative_config warns when a K past it is served
    notes = [] if dflash else formats.reader_notes(cfg, format, target_layers=int(target_cfg["num_hidden_layers"]))
    for reader, note in notes:
        log.warning("%s: %s", reader, note)
    state = _load_state(ckpt_dir, info)
    info.setdefault("num_parameters", sum(t.numel() for n, t in state.items()
                                          if t.is_floating_point() and not n.startswith("embed_tokens.")))
    tensors = {}
    for name, t in state.items():
        if name.startswith("embed_tokens."):
            continue
        tensors[name] = t.to(DTYPES[dtype]).contiguous() if t.is_floating_point() else t.contiguous()
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    _check_values(tensors, state, dtype=dtype, vocab_size=cfg["vocab_size"], path=Path(ckpt_dir) / WEIGHTS)
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:  # the whole vocabulary, d2t the identity (_check_values):
        del tensors["d2t"], tensors["t2d"]  # vLLM's draft models have no map to load them into, and refuse them
    if quantization == "fp8":
        tensors = fp8.quantise_state(tensors)
        cfg["quantization_config"] = fp8.quantization_config()
    if format == "speculators":
        tensors = formats.speculators_tensors(tensors)

    make_dir(out_dir.parent, key, error=ConfigError)
    sweep_leftovers(out_dir)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_side_prefix(out_dir, "tmp"), dir=out_dir.parent))
        os.chmod(tmp, 0o777 & ~umask())  # the user's umask decides, not mkdtemp's owner-only 0700
    except OSError as exc:  # e.g. a name too long for the side folder the export is written in
        raise ConfigError(f"{key}: {shown_path(out_dir)}: cannot write beside it ({exc.strerror or exc})") from None
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask())  # safetensors writes 0600 (a temp file renamed)
        write_json_atomic(tmp / "config.json", written)
        meta = info.get("feature_meta") or {}
        inputs = {"checkpoint": str(ckpt_dir), "step": info.get("step"), "store_uri": info.get("store_uri"),
                  "table": info.get("table") or "features", "version": info.get("table_version"),
                  "target": str(target_dir), "feature_set_id": meta.get("feature_set_id"),
                  "feature_identity": meta.get("identity")}
        write_provenance(tmp, config=recipe or {"serve": {"dtype": dtype, "quantization": quantization,
                                                          "format": format}},
                         argv=argv, inputs=inputs, extra={"format": format, "stage": STAGE})
        card = (dflash_card(cfg, info, inputs, format=format) if dflash
                else model_card({**cfg, RECOMMENDED_K: k}, info, inputs, format=format, notes=notes))
        (tmp / "README.md").write_text(card, encoding="utf-8")
        _install(tmp, out_dir, key)
    except OSError as exc:
        raise StoreError(f"{key}: cannot write {shown_path(out_dir)} ({exc.strerror or type(exc).__name__})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when installed
    log.info("exported draft (%s format, %s%s, %d tensors) to %s", format, dtype,
             ", fp8 linears" if quantization == "fp8" else "", len(tensors), out_dir)
    return shown


def _check_info(info: dict[str, Any], path: Path) -> None:
    """checkpoint.json has what export reads: ``draft_config`` (its keys) and ``layer_ids``."""
    d = info.get("draft_config")
    if not isinstance(d, dict):
        raise StoreError(f"{shown_path(path)}: no draft_config; the checkpoint is damaged: train again (`train run`)")
    ids = info.get("layer_ids")
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            or len(set(ids)) != len(ids)):
        raise StoreError(f"{shown_path(path)}: layer_ids: a list of distinct layer ids, got {short(ids, 60)}; "
                         "the checkpoint is damaged: train again (`train run`)")
    for k in DRAFT_KEYS + (DFLASH_KEYS if d.get("dflash") else ()):
        if not isinstance(d.get(k), (int, float)) or isinstance(d.get(k), bool):
            raise StoreError(f"{shown_path(path)}: draft_config.{k}: a number, got {str(d.get(k))[:60]}; "
                             "the checkpoint is damaged: train again (`train run`)")
    if d.get("dflash") and not _is_count(d["num_hidden_layers"], 1):
        raise StoreError(f"{shown_path(path)}: draft_config.num_hidden_layers: a whole number >= 1, got "
                         f"{short(d['num_hidden_layers'])}; the checkpoint is damaged: train again (`train run`)")
    _check_layers(info, path)
    _check_record(info, path)  # first: train_config an object, which _check_family reads
    _check_family(info, path)
    act = d.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:  # a draft trained with its target's activation (Apertus: xielu)
        raise ConfigError(f"{shown_path(path)}: draft_config.hidden_act is {short(act)}, the target's activation; "
                          f"vLLM's draft layers run {ACTIVATION} MLPs only and refuse this draft at engine start: "
                          f"train the draft again with a {ACTIVATION} MLP")


def _check_layers(info: dict[str, Any], path: Path) -> None:
    """The aux layers export writes (``layer_ids``) are the ones the draft's ``fc`` reads
    (``draft_config.eagle_aux_layer_ids``, its width), its hidden size is its target's (vLLM shares the
    target's embeddings) and its rotary settings an object."""
    d, ids = info["draft_config"], info["layer_ids"]
    built = d.get("eagle_aux_layer_ids")
    if isinstance(built, list) and sorted(built) != sorted(ids):
        raise StoreError(f"{shown_path(path)}: layer_ids {short(ids, 60)} are not the aux layers draft_config reads "
                         f"({short(built, 60)}); the checkpoint is damaged: train again (`train run`)")
    if d["hidden_size"] != d["target_hidden_size"]:
        raise StoreError(f"{shown_path(path)}: draft_config.hidden_size {d['hidden_size']} is not the target's "
                         f"{d['target_hidden_size']} (vLLM shares the target's embeddings); the checkpoint is "
                         "damaged: train again (`train run`)")
    if d.get("rope_parameters") is not None and not isinstance(d["rope_parameters"], dict):
        raise StoreError(f"{shown_path(path)}: draft_config.rope_parameters: an object, got "
                         f"{short(d['rope_parameters'], 60)}; the checkpoint is damaged: train again (`train run`)")
    _check_window(d, path)


def _check_window(d: dict[str, Any], path: Path) -> None:
    """A windowed draft's ``layer_types`` is a list of names and its ``sliding_window`` a whole number
    of tokens >= 1 (written to config.json as is: vLLM would give the layer a window of 0 or "x")."""
    types = d.get("layer_types")
    if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
        raise StoreError(f"{shown_path(path)}: draft_config.layer_types: a list of attention kinds, got "
                         f"{short(types, 60)}; the checkpoint is damaged: train again (`train run`)")
    if "sliding_attention" in (types or ()) and not _is_count(d.get("sliding_window"), 1):
        raise StoreError(f"{shown_path(path)}: draft_config.sliding_window: a whole number of tokens >= 1 for a "
                         f"sliding_attention layer, got {short(d.get('sliding_window'))}; the checkpoint is damaged: "
                         "train again (`train run`)")


def _check_family(info: dict[str, Any], path: Path) -> None:
    """The family (and depth) ``train_config`` records is the draft ``draft_config`` builds: the K the
    export records comes from the first, the weights from the second."""
    d, train = info["draft_config"], info.get("train_config") or {}
    family = checkpoint_family(d)
    recorded = train.get("family") or "eagle3"
    if recorded in ("eagle3", "peagle", "dflash") and recorded != family:  # (another value: _recommended_k's)
        raise StoreError(f"{shown_path(path)}: train_config.family {short(recorded)} does not describe the "
                         f"{family} draft in draft_config; the checkpoint is damaged: train again (`train run`)")
    steps = train.get("ttt_steps")
    if family == "eagle3" and steps is not None and not _is_count(steps, 1):  # the K the export records
        raise StoreError(f"{shown_path(path)}: train_config.ttt_steps: a whole number >= 1, got {short(steps)}; "
                         "the checkpoint is damaged: train again (`train run`)")
    for section, key, built in (("peagle", "num_slots", d.get("peagle_num_slots")),
                                ("dflash", "block_size", d.get("dflash_block_size"))):
        said = train[section].get(key) if isinstance(train.get(section), dict) else None
        for name, value in ((f"train_config.{section}.{key}", said), (f"draft_config.{section}_{key}", built)):
            if family == section and value is not None and not _is_count(value, 2):  # the K the export records
                raise StoreError(f"{shown_path(path)}: {name}: a whole number >= 2, got {short(value)}; "
                                 "the checkpoint is damaged: train again (`train run`)")
        if family == section and None not in (said, built) and said != built:
            raise StoreError(f"{shown_path(path)}: train_config.{section}.{key} {short(said)} is not the draft's "
                             f"{built} (draft_config); the checkpoint is damaged: train again (`train run`)")


def checkpoint_family(draft_config: dict[str, Any]) -> str:
    """The family of the draft a checkpoint's ``draft_config`` builds: dflash, peagle or eagle3."""
    return "dflash" if draft_config.get("dflash") else "peagle" if draft_config.get("parallel_drafting") else "eagle3"


def _check_record(info: dict[str, Any], path: Path) -> None:
    """The run's record the model card prints: objects where it reads keys, numbers where it formats
    numbers (a damaged checkpoint.json is one line naming the key, not a traceback from the card)."""
    metrics = info.get("metrics") if isinstance(info.get("metrics"), dict) else {}
    checks = [(key, "an object", info.get(key), lambda v: isinstance(v, dict))
              for key in ("train_config", "metrics", "feature_meta")]
    checks += [(key, "a number", value, _is_number) for key, value in (
        ("vocab_coverage", info.get("vocab_coverage")), ("num_parameters", info.get("num_parameters")),
        ("metrics.loss", metrics.get("loss")))]
    checks.append(("metrics.step_acc", "a list of numbers", metrics.get("step_acc"),
                   lambda v: isinstance(v, list) and all(_is_number(x) for x in v)))
    for key, want, value, ok in checks:
        if value is not None and not ok(value):
            raise StoreError(f"{shown_path(path)}: {key}: {want}, got {short(value)}; "
                             "the checkpoint is damaged: train again (`train run`)")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_count(value: Any, low: int) -> bool:
    """A whole number >= ``low`` (4.5 would be written as 4; a block of one slot drafts nothing)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _recommended_k(info: dict[str, Any], path: Path, *, read=recommended_num_speculative_tokens) -> int:
    """The K the checkpoint's ``train_config`` recommends (``read``: or the depth it was trained for);
    a damaged one is one line naming the file."""
    try:
        return read(info.get("train_config") or {})
    except (ConfigError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"{shown_path(path)}: train_config: {str(exc)[:120]}; the checkpoint is damaged: "
                         "train again (`train run`)") from None


def _check_target(info: dict[str, Any], target_cfg: dict[str, Any], *, target: Path, ckpt: Path) -> None:
    """The checkpoint was trained for this target: its config has the sizes export reads, the same
    vocabulary and width, and the aux layers the draft reads (vLLM ids 0..layers - 1)."""
    where = shown_path(target / "config.json")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        value = target_cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"run.target: {where}: {key}: a positive integer, got {short(value)}")
    d = info["draft_config"]
    for key, mine in (("vocab_size", d.get("vocab_size", target_cfg["vocab_size"])),
                      ("hidden_size", d["target_hidden_size"])):
        if mine != target_cfg[key]:
            raise ConfigError(f"run.target: {where} has {key} {target_cfg[key]}, the draft in {shown_path(ckpt)} "
                              f"was trained on a target with {mine}; export it with the target it was trained for")
    mask = d.get("mask_token_id")
    if (d.get("dflash") or d.get("parallel_drafting")) and (
            isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target_cfg["vocab_size"]):
        raise StoreError(f"{shown_path(ckpt)}: draft_config.mask_token_id: a token id of the target's vocabulary "
                         f"(0..{target_cfg['vocab_size'] - 1}), got {short(mask)}; the checkpoint is damaged: "
                         "train again (`train run`)")
    layers = target_cfg["num_hidden_layers"]
    bad = [i for i in info["layer_ids"] if not 0 <= i < layers]
    if bad:
        raise ConfigError(f"run.target: {where} has {layers} layers, the draft in {shown_path(ckpt)} reads aux "
                          f"layers {bad} (vLLM ids 0..{layers - 1}); export it with the target it was trained for")


def _check_values(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], *, dtype: str,
                  vocab_size: int, path: Path) -> None:
    """The weights to write are finite (a diverged run's NaN, or a value past ``dtype``'s range, is
    refused naming the tensor) and ``d2t`` maps each draft id to its own id of the target."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            if not bool(torch.isfinite(state[name]).all()):
                raise StoreError(f"{shown_path(path)}: tensor {name} holds NaN or infinite values (training "
                                 "diverged?); train again (`train run`) or export an earlier checkpoint")
            raise ConfigError(f"serve.dtype: tensor {name} of {shown_path(path)} has values past {dtype}'s range "
                              f"(largest |w| {float(state[name].abs().max()):.4g}); export with serve.dtype=float32 "
                              "or bfloat16")
    why = vocab_map_error(tensors["d2t"].numpy(), vocab_size, tensors["t2d"].numpy()) or whole_vocab_error(
        tensors["d2t"].numpy(), vocab_size)
    if why:
        raise StoreError(f"{shown_path(path)}: {why}; the checkpoint is damaged: train again (`train run`)")


def _load_state(ckpt_dir: str | Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, each checked against the shape checkpoint.json's config gives it (a
    weights file and a checkpoint.json of two different runs are refused, naming the tensor)."""
    from safetensors.torch import load_file

    path = Path(ckpt_dir) / WEIGHTS
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        why = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable: {str(exc).splitlines()[0][:100]}"
        raise StoreError(f"{shown_path(path)}: {why}; the checkpoint is damaged: train again (`train run`)") from None
    try:
        cfg = LlamaConfig.from_dict(info["draft_config"])
        with torch.device("meta"):  # shapes only: no memory, no init
            model = DFlashDraft(cfg) if is_dflash(cfg) else Eagle3Draft(cfg)
    except Exception as exc:  # noqa: BLE001 - any config the model cannot be built from is the file's fault
        raise StoreError(f"{shown_path(Path(ckpt_dir) / INFO)}: draft_config does not build a draft "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}); "
                         "the checkpoint is damaged: train again (`train run`)") from None
    built = {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")}
    want = {k: tuple(v.shape) for k, v in built.items()}
    for name, t in state.items():
        if name.startswith("embed_tokens."):
            continue
        if name not in want:
            raise StoreError(f"{shown_path(path)}: tensor {name} is not in the draft {INFO} describes; "
                             "the weights and checkpoint.json come from different runs")
        if tuple(t.shape) != want[name]:
            raise StoreError(f"{shown_path(path)}: tensor {name} is {list(t.shape)}, {INFO}'s config makes it "
                             f"{list(want[name])}; the weights and checkpoint.json come from different runs")
        if t.is_floating_point() != built[name].is_floating_point():  # exported as is: int weights, float maps
            raise StoreError(f"{shown_path(path)}: tensor {name} is {str(t.dtype).removeprefix('torch.')}, the "
                             f"draft's is {str(built[name].dtype).removeprefix('torch.')}; the checkpoint is "
                             "damaged: train again (`train run`)")
    missing = sorted(set(want) - set(state))
    if missing:
        raise StoreError(f"{shown_path(path)}: no tensor {missing[0]} ({len(missing)} missing); "
                         "the checkpoint is damaged: train again (`train run`)")
    return state


def _side_prefix(out_dir: Path, kind: str) -> str:
    """The name prefix of an export's side folder beside ``out_dir`` (``kind``: ``tmp``, the export
    being written; ``old``, the earlier export moved aside), tagged with the writing process's pid."""
    return pid_prefix(f".{out_dir.name}.{kind}-")


def sweep_leftovers(out_dir: Path) -> list[Path]:
    """Remove the side folders of an export of ``out_dir`` that was killed (its pid is gone): a
    half-written ``tmp`` or an ``old`` export moved aside. If the kill landed between the two renames
    (``out_dir`` missing), the old export is put back first. Returns what was removed."""
    removed = []
    for kind in ("old", "tmp"):  # an old export is put back before anything else is looked at
        for side in orphans(out_dir.parent, f".{out_dir.name}.{kind}-"):
            if kind == "old" and not out_dir.exists() and is_export(side):
                os.replace(side, out_dir)
                log.warning("put back the export %s, moved aside by a killed export", shown_path(out_dir))
                continue
            shutil.rmtree(side, ignore_errors=True)
            removed.append(side)
    if removed:
        log.info("removed %d folder(s) a killed export left beside %s", len(removed), shown_path(out_dir))
    return removed


def _install(tmp: Path, out_dir: Path, key: str) -> None:
    """Rename the finished export ``tmp`` to ``out_dir``; an earlier export there is moved aside first
    and removed only once the new one is in place (put back if the rename fails)."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_export(out_dir):  # filled since check_out
        raise ConfigError(f"{key}: {shown_path(out_dir)} holds files that are not an exported draft; "
                          "choose an empty or new folder")
    install_dir(tmp, out_dir)
