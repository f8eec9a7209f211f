"""``serve export``'s checks of a training checkpoint before anything is written.

checkpoint.json (its ``draft_config``, ``layer_ids``, record of the run), the target it is exported
with, and the weights (shapes from a meta-device build of the draft, finite values, the vocabulary
map). Each refusal is one line naming the file and the key or tensor; the trade-off is reading the
whole weights file once here, which export then writes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import LlamaConfig

from eaglenest.config import short
from eaglenest.errors import ConfigError, StoreError
from eaglenest.paths import shown_path
from eaglenest.serve.draft_files import vocab_map_error, whole_vocab_error
from eaglenest.serve.export_config import ACTIVATION
from eaglenest.train.checkpoint import INFO, WEIGHTS
from eaglenest.train.config import recommended_num_speculative_tokens
from eaglenest.train.dflash import DFlashDraft, is_dflash
from eaglenest.train.model import Eagle3Draft

#: draft_config keys the exported config.json needs (DFlash: also DFLASH_KEYS).
DRAFT_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "draft_vocab_size", "target_hidden_size", "rms_norm_eps")
DFLASH_KEYS = ("num_hidden_layers", "dflash_block_size", "mask_token_id")


def check_info(info: dict[str, Any], path: Path) -> None:
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
    if recorded in ("eagle3", "peagle", "dflash") and recorded != family:  # (another value: recommended_k's)
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


def recommended_k(info: dict[str, Any], path: Path, *, read=recommended_num_speculative_tokens) -> int:
    """The K the checkpoint's ``train_config`` recommends (``read``: or the depth it was trained for);
    a damaged one is one line naming the file."""
    try:
        return read(info.get("train_config") or {})
    except (ConfigError, TypeError, ValueError, AttributeError) as exc:
        raise StoreError(f"{shown_path(path)}: train_config: {str(exc)[:120]}; the checkpoint is damaged: "
                         "train again (`train run`)") from None


def check_target(info: dict[str, Any], target_cfg: dict[str, Any], *, target: Path, ckpt: Path) -> None:
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


def check_values(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], *, dtype: str,
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


def load_state(ckpt_dir: str | Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, each checked against the shape checkpoint.json's config gives it (a
    weights file and a checkpoint.json of two different runs are refused, naming the tensor)."""
    from safetensors.torch import load_file

    path = Path(ckpt_dir) / WEIGHTS
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        why = "missing" if isinstance(exc, FileNotFoundError) else f"unreadable: {str(exc).splitlines()[0][:100]}"
        raise StoreError(f"{shown_path(path)}: {why}; the checkpoint is damaged: train again (`train run`)") from None
    draft = info["draft_config"]
    if draft.get("dflash") and draft.get("mlp_bias"):  # a DFlash run from before its MLP was made bias-free
        state = _without_mlp_bias(state, path)
        draft = {**draft, "mlp_bias": False}
    try:
        cfg = LlamaConfig.from_dict(draft)
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


def _without_mlp_bias(state: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """A DFlash draft's weights without the MLP biases its run trained (``draft_config.mlp_bias``, the
    target's, before eaglenest.train.dflash made the MLP bias-free). vLLM's DFlash layer has a bias-free
    MLP and its loader drops such biases without a word: all zero, they compute nothing and are left
    out; any other value is refused, as the draft vLLM would serve is not the one trained."""
    biases = [n for n in state if ".mlp." in n and n.endswith(".bias")]
    trained = [n for n in biases if state[n].is_floating_point() and bool(state[n].any())]
    if trained:
        raise StoreError(f"{shown_path(path)}: a DFlash draft trained with MLP biases ({trained[0]}, ...: "
                         "draft_config.mlp_bias true), which vLLM's bias-free DFlash MLP drops when it loads them; "
                         "train the draft again (`train run`: DFlash MLPs are now bias-free)")
    return {n: t for n, t in state.items() if n not in biases}
