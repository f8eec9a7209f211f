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

This module holds the folder handling (what may be replaced, the side folders, the final rename) and
the order of the steps; the config.json of each family is ``serve/export_config.py``'s and the checks
of the checkpoint, its target and its weights ``serve/export_checks.py``'s.
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

from eaglenest.config import short
from eaglenest.engine import RECOMMENDED_K, TRAINED_K
from eaglenest.errors import ConfigError, StoreError
from eaglenest.paths import install_dir, make_dir, orphans, pid_prefix, shown_path, umask, user_path
from eaglenest.provenance import write_json_atomic, write_provenance
from eaglenest.serve import formats, fp8
from eaglenest.serve.cards import dflash_card, model_card
from eaglenest.serve.export_checks import (check_info, check_target, check_values, checkpoint_family, load_state,
                                           recommended_k)
from eaglenest.serve.export_config import dflash_hf_config, draft_hf_config
from eaglenest.serve.run_check import check_finished
from eaglenest.serve.target_check import check_target_weights, check_tokenization
from eaglenest.target import read_config
from eaglenest.train.checkpoint import INFO, WEIGHTS, read_info
from eaglenest.train.config import trained_num_speculative_tokens
from eaglenest.train.target import target_config, torch_dtype_name

__all__ = ["check_out", "dflash_hf_config", "draft_hf_config", "export_draft", "is_export", "sweep_leftovers"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: What an export writes, and all it writes: a folder holding only these (config.json and
#: provenance.json among them, in the shapes export writes) is an earlier export, the one kind of
#: folder ``serve export`` replaces. Any other non-empty folder is refused, never deleted.
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "README.md", "provenance.json"})
#: provenance.json's ``stage`` in an export (exports made before it are recognised by their shape).
STAGE = "serve export"


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
    check_info(info, Path(ckpt_dir) / INFO)
    trained_as = checkpoint_family(info["draft_config"])
    if family is not None and family != trained_as:  # the recipe says another draft than the one trained
        raise ConfigError(f"train.family={family}: {shown_path(Path(ckpt_dir) / INFO)} holds a {trained_as} draft; "
                          f"export it with train.family={trained_as}, or train a {family} draft first (`train run` "
                          f"with train.family={family})")
    target_cfg = target_config(target_dir)
    check_target(info, target_cfg, target=Path(target_dir), ckpt=Path(ckpt_dir) / INFO)
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
    k = num_speculative_tokens or recommended_k(info, Path(ckpt_dir) / INFO)
    if format == "vllm" or dflash:  # (a speculators config carries k in its proposal; the DFlash card reads it here)
        cfg[RECOMMENDED_K] = k  # serve / evaluate use it when their num_speculative_tokens is null
    trained = recommended_k(info, Path(ckpt_dir) / INFO, read=trained_num_speculative_tokens)
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
    state = load_state(ckpt_dir, info)
    info.setdefault("num_parameters", sum(t.numel() for n, t in state.items()
                                          if t.is_floating_point() and not n.startswith("embed_tokens.")))
    tensors = {}
    for name, t in state.items():
        if name.startswith("embed_tokens."):
            continue
        tensors[name] = t.to(DTYPES[dtype]).contiguous() if t.is_floating_point() else t.contiguous()
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    check_values(tensors, state, dtype=dtype, vocab_size=cfg["vocab_size"], path=Path(ckpt_dir) / WEIGHTS)
    if cfg["draft_vocab_size"] == cfg["vocab_size"]:  # the whole vocabulary, d2t the identity (check_values):
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
