"""What an exported draft directory must hold for vLLM to serve it with a target, checked from its
files before an engine starts (``serve up``; ``serve export`` checks the vocabulary map it writes).

vLLM reads a draft's weights only once its engine is up (20-60 s), stops at a tensor of the wrong
shape with a traceback in its log, and does not check the vocabulary map at all: its EAGLE-3 head
scatters the draft's logits to ``arange(draft_vocab) + d2t``, so an offset past the target's
vocabulary fails mid-request and a missing ``d2t`` maps draft ids as target ids (lossless, but
the draft's proposals are other tokens). The config.json keys serving reads are checked too (the K
a round drafts, the aux layer ids, a P-EAGLE or DFlash mask token): vLLM fails on them once started,
or eaglenest would serve another K. So are the shape keys vLLM builds the draft from, against the
weights' header: ``num_hidden_layers`` (vLLM builds that many layers and fails on one the weights lack
or hold beyond) and the aux layers vLLM concatenates for ``fc`` (too many or too few fail at start-up
or on the first request). The trade-off: only config.json, the safetensors header and the small
``d2t`` / ``t2d`` tensors are read (numpy, no torch), so the check costs milliseconds; the other
weights' shapes are vLLM's to check.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from eaglenest.config import short
from eaglenest.engine import RECOMMENDED_K, TRAINED_K, draft_family, is_count, is_int
from eaglenest.errors import ConfigError
from eaglenest.paths import shown_path
from eaglenest.target import language_config, read_config

WEIGHTS = "model.safetensors"
#: config.json keys that give the K a round drafts (eaglenest.engine: the default and the trained depth).
K_KEYS = (RECOMMENDED_K, TRAINED_K)
#: speculators' model types eaglenest serves (eaglenest.engine.speculative_config builds their method).
SPECULATORS_TYPES = ("eagle3", "peagle", "dflash")
#: A decoder layer's weight name: the vLLM format's ``midlayer.*`` (its one layer) or ``layers.N.*``.
_LAYER_NAME = re.compile(r"^(?:midlayer|layers\.(\d+))\.")
_AGAIN = "export the draft again (`serve export`)"


def vocab_map_error(d2t: np.ndarray, vocab_size: int, t2d: np.ndarray | None = None) -> str | None:
    """What is wrong with the offsets ``d2t`` (target id = draft id + ``d2t[draft id]``) for a target
    of ``vocab_size`` tokens, or None: each draft id must map to a distinct id of the target, and
    ``t2d`` (when given: True where a target id is in the draft vocabulary) must mark exactly those."""
    if d2t.ndim != 1 or d2t.dtype.kind not in "iu":
        return f"d2t is {d2t.dtype} {list(d2t.shape)}, not a 1-D integer tensor"
    targets = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    bad = np.flatnonzero((targets < 0) | (targets >= vocab_size))
    if bad.size:
        i = int(bad[0])
        return (f"d2t maps draft id {i} to target id {int(targets[i])}, outside the target's vocabulary "
                f"0..{vocab_size - 1} ({bad.size} such ids)")
    if np.unique(targets).size != targets.size:
        return "d2t maps two draft ids to the same target id"
    return None if t2d is None else _t2d_error(t2d.astype(bool), targets)


def whole_vocab_error(d2t: np.ndarray, vocab_size: int) -> str | None:
    """What is wrong with ``d2t`` for a draft whose vocabulary is the target's whole one: vLLM's draft
    models then take draft ids as target ids (they have no map to load), so every offset must be 0."""
    moved = np.flatnonzero(d2t) if d2t.shape == (vocab_size,) else []
    return (f"d2t maps draft id {int(moved[0])} to another target id, but the draft vocabulary is the target's "
            "whole vocabulary, whose ids vLLM serves as they are") if len(moved) else None


def _t2d_error(t2d: np.ndarray, targets: np.ndarray) -> str | None:
    """Whether ``t2d`` marks exactly the target ids ``targets`` that d2t maps the draft ids to."""
    unmarked = targets[~t2d[targets]] if t2d.shape[0] > int(targets.max(initial=-1)) else targets
    if unmarked.size:
        return (f"t2d does not mark target id {int(unmarked[0])}, which d2t maps a draft id to "
                f"({unmarked.size} such ids): the two vocabulary maps disagree")
    if int(t2d.sum()) != targets.size:
        return (f"t2d marks {int(t2d.sum())} target ids, d2t maps the draft's {targets.size} to: "
                "the two vocabulary maps disagree")
    return None


def check_draft_dir(draft: str | Path, target_cfg: dict[str, Any] | None = None) -> None:
    """Refuse (ConfigError, one line naming the file) a draft directory vLLM would fail to load or
    would serve wrongly: weights missing or unreadable, a ``d2t`` / ``t2d`` of the wrong length or
    mapping outside the vocabulary (or any ``d2t`` for a draft of the whole vocabulary), or
    (``target_cfg``: the target's language config) a draft exported for a target of another vocabulary
    or width."""
    draft = Path(draft)
    cfg = _read_config(draft / "config.json")
    layer = cfg.get("transformer_layer_config") if isinstance(cfg.get("transformer_layer_config"), dict) else {}
    vocab = cfg.get("vocab_size", layer.get("vocab_size"))
    draft_vocab = cfg.get("draft_vocab_size")
    hidden = cfg.get("target_hidden_size", cfg.get("hidden_size", layer.get("hidden_size")))
    where = shown_path(draft / "config.json")
    for key, value in (("vocab_size", vocab), ("draft_vocab_size", draft_vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: {key}: a positive integer, got {str(value)[:40]}; {_AGAIN}")
    if target_cfg is not None:
        for key, mine in (("vocab_size", vocab), ("hidden_size", hidden)):
            theirs = target_cfg.get(key)
            if isinstance(theirs, int) and mine != theirs:
                raise ConfigError(f"{where}: a draft for a target with {key} {mine}, run.target has {theirs}; "
                                  "serve it with the target it was trained for, or export it for this one")
    _check_serving_keys(cfg, where, vocab, target_cfg)
    shapes, d2t, t2d = _read_weights(draft / WEIGHTS)
    wpath = shown_path(draft / WEIGHTS)
    _check_layer_count(cfg, layer, shapes, where, wpath)
    _check_fc_width(cfg, layer, shapes.get("fc.weight"), hidden, where, wpath)
    if d2t is None:
        if draft_vocab != vocab:
            raise ConfigError(f"{wpath}: no d2t tensor for a draft vocabulary of {draft_vocab} of {vocab} "
                              f"target ids (vLLM would take draft ids for target ids); {_AGAIN}")
        return
    if draft_vocab == vocab:  # vLLM's draft models then have no map to load d2t into: refused at engine start
        raise ConfigError(f"{wpath}: a d2t tensor, which vLLM refuses for a draft vocabulary that is the target's "
                          f"whole vocabulary ({vocab} ids); {_AGAIN}")
    if d2t.shape != (draft_vocab,):
        raise ConfigError(f"{wpath}: d2t is {list(d2t.shape)}, config.json's draft_vocab_size makes it "
                          f"[{draft_vocab}]; {_AGAIN}")
    if t2d is not None and t2d.shape != (vocab,):
        raise ConfigError(f"{wpath}: t2d is {list(t2d.shape)}, config.json's vocab_size makes it [{vocab}]; {_AGAIN}")
    why = vocab_map_error(d2t, vocab, t2d)
    if why:
        raise ConfigError(f"{wpath}: {why}; {_AGAIN}")


def _check_serving_keys(cfg: dict[str, Any], where: str, vocab: int, target_cfg: dict[str, Any] | None) -> None:
    """The keys of config.json that serving reads, typed: the K a round drafts, the aux layers the
    draft reads (inside the target's, when ``target_cfg`` is known) and a P-EAGLE or DFlash mask token;
    ``architectures``, which vLLM renames class by class to its draft model."""
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and all(isinstance(a, str) and a for a in archs)):
        raise ConfigError(f"{where}: architectures: a list of model class names, got {short(archs)}; {_AGAIN}")
    _check_draft_class(cfg, archs, where)
    _check_k(cfg, where)
    _check_aux_layers(cfg, where, (target_cfg or {}).get("num_hidden_layers"))
    flag = cfg.get("parallel_drafting")
    if flag is not None and not isinstance(flag, bool):  # "yes" reads as no flag: a P-EAGLE draft served sequentially
        raise ConfigError(f"{where}: parallel_drafting: true or false, got {short(flag)}; {_AGAIN}")
    family = draft_family(cfg)
    if family in ("peagle", "dflash"):
        dflash = cfg["dflash_config"] if isinstance(cfg.get("dflash_config"), dict) else {}
        mask = cfg.get("mask_token_id", dflash.get("mask_token_id"))
        if not (is_int(mask) and 0 <= mask < vocab):
            raise ConfigError(f"{where}: mask_token_id: a token id of the target's vocabulary (0..{vocab - 1}) for "
                              f"a {family} draft, got {short(mask)}; {_AGAIN}")


def vllm_draft_classes(archs: list[str], family: str) -> list[str]:
    """The classes vLLM looks up for a vLLM-format draft's ``architectures`` (its EAGLEConfig renames
    ``X`` to ``Eagle3X``, or ``DFlashX`` for a DFlash draft, unless the name already says so)."""
    prefix = "DFlash" if family == "dflash" else "Eagle3"
    keep = ("LiLiCorrDraftModel",) if family == "dflash" else ()
    return [a if a.startswith(prefix) or a.endswith(prefix) or a in keep else f"{prefix}{a}" for a in archs]


def _check_draft_class(cfg: dict[str, Any], archs: list[str], where: str) -> None:
    """A vLLM-format draft's ``architectures`` name a draft class vLLM has (a speculators config's are
    speculators' own names, which vLLM maps by ``speculators_model_type``): vLLM's refusal comes
    once its engine started, as a traceback listing its few hundred classes. Not checked without vLLM."""
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        return
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return
    wanted = vllm_draft_classes(archs, draft_family(cfg))
    if not set(wanted) & set(ModelRegistry.get_supported_archs()):
        raise ConfigError(f"{where}: architectures: {', '.join(archs)} is no draft model class the installed vLLM "
                          f"has (it would look for {', '.join(wanted)}); {_AGAIN}")


def _check_k(cfg: dict[str, Any], where: str) -> None:
    """eaglenest's K keys, when present, and a speculators config's first proposal (vLLM requires it)."""
    for key in K_KEYS:
        if key in cfg and not is_count(cfg[key]):
            raise ConfigError(f"{where}: {key}: a positive integer, got {short(cfg[key])}; {_AGAIN}")
    if "speculators_model_type" not in cfg and "speculators_config" not in cfg:
        return
    if cfg.get("speculators_model_type") not in SPECULATORS_TYPES:  # vLLM refuses others, or serves them otherwise
        raise ConfigError(f"{where}: speculators_model_type: one of {', '.join(SPECULATORS_TYPES)}, got "
                          f"{short(cfg.get('speculators_model_type'))}; {_AGAIN}")
    spec = cfg.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not (isinstance(methods, list) and methods and all(isinstance(m, dict) for m in methods)):
        raise ConfigError(f"{where}: speculators_config.proposal_methods: a list of objects, got "
                          f"{short(methods)}; {_AGAIN}")
    k = methods[0].get("speculative_tokens")
    if not is_count(k):
        raise ConfigError(f"{where}: speculators_config.proposal_methods[0].speculative_tokens: a positive "
                          f"integer, got {short(k)}; {_AGAIN}")


def _check_aux_layers(cfg: dict[str, Any], where: str, layers: Any) -> None:
    """The aux layer ids are a list of integers, each a layer of the target's ``layers`` (when known)."""
    key, ids = _aux_layer_ids(cfg)
    if ids is not None and not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)):
        raise ConfigError(f"{where}: {key}: a list of layer ids, got {short(ids)}; {_AGAIN}")
    past = [i for i in ids or () if is_count(layers) and not 0 <= i < layers]
    if past:
        raise ConfigError(f"{where}: {key}: the draft reads aux layers {past}, run.target has {layers} layers "
                          f"(vLLM ids 0..{layers - 1}); serve it with the target it was trained for, or export it "
                          "for this one")


def _check_layer_count(cfg: dict[str, Any], layer: dict[str, Any], shapes: dict[str, list[int]], where: str,
                       wpath: str) -> None:
    """``num_hidden_layers`` (a speculators config's in ``transformer_layer_config``) is the number of
    decoder layers the weights hold: vLLM builds that many and fails at start-up on any other."""
    key = "num_hidden_layers" if "num_hidden_layers" in cfg or "num_hidden_layers" not in layer \
        else "transformer_layer_config.num_hidden_layers"
    n = cfg.get("num_hidden_layers", layer.get("num_hidden_layers"))
    if not is_count(n):
        raise ConfigError(f"{where}: {key}: a positive integer, got {short(n)}; {_AGAIN}")
    held = {m.group(1) or "0" for m in map(_LAYER_NAME.match, shapes) if m}
    if held and n != len(held):
        raise ConfigError(f"{where}: {key} is {n}, {wpath} holds {len(held)} decoder layer(s); {_AGAIN}")


def _check_fc_width(cfg: dict[str, Any], layer: dict[str, Any], fc: list[int] | None, hidden: Any, where: str,
                    wpath: str) -> None:
    """``fc`` reads as many aux layers as vLLM concatenates (the ids it gathers) and builds it for
    (an EAGLE-3 draft: ``num_aux_hidden_states``, else ``eagle_config``'s list's length, else 3), and
    is used at all (``eagle_config.use_aux_hidden_state`` false makes vLLM drop it)."""
    if fc is None or len(fc) != 2 or not is_count(hidden):
        return
    key, ids = _aux_layer_ids(cfg)
    counts = [(key, len(ids))] if isinstance(ids, list) else []
    if draft_family(cfg) != "dflash":
        src = layer if "speculators_config" in cfg else cfg  # what vLLM's draft config holds
        eagle = src.get("eagle_config") if isinstance(src.get("eagle_config"), dict) else {}
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ConfigError(f"{where}: eagle_config.use_aux_hidden_state: true for a draft with fc.weight "
                              f"(vLLM would drop fc), got {short(eagle['use_aux_hidden_state'])}; {_AGAIN}")
        nested = eagle.get("eagle_aux_hidden_state_layer_ids")
        if "num_aux_hidden_states" in src:
            counts.append(("num_aux_hidden_states", src["num_aux_hidden_states"]))
        elif isinstance(nested, list) and nested:
            counts.append(("eagle_config.eagle_aux_hidden_state_layer_ids", len(nested)))
        else:
            counts.append(("num_aux_hidden_states (missing: vLLM takes 3)", 3))
    for name, count in counts:
        if not is_count(count) or count * hidden != fc[1]:
            raise ConfigError(f"{where}: {name}: {short(count)} aux layers of {hidden} do not make the input of "
                              f"{wpath}'s fc.weight {fc}; {_AGAIN}")


def _aux_layer_ids(cfg: dict[str, Any]) -> tuple[str, Any]:
    """(key, value) of the aux layer ids vLLM reads from config.json, in vLLM's ids (a flat DFlash
    config's ``target_layer_ids`` are one less); the value is None when the config names none."""
    if "eagle_aux_hidden_state_layer_ids" in cfg or "aux_hidden_state_layer_ids" in cfg:
        key = "eagle_aux_hidden_state_layer_ids" if "eagle_aux_hidden_state_layer_ids" in cfg \
            else "aux_hidden_state_layer_ids"
        return key, cfg[key]
    ids = cfg["dflash_config"].get("target_layer_ids") if isinstance(cfg.get("dflash_config"), dict) else None
    if isinstance(ids, list) and all(is_int(i) for i in ids):
        ids = [i + 1 for i in ids]
    return "dflash_config.target_layer_ids", ids




def local_target_config(target: str | Path) -> dict[str, Any] | None:
    """A local target's language config, for :func:`check_draft_dir` (None for a hub id)."""
    if not (Path(target) / "config.json").is_file():
        return None
    cfg = read_config(target)
    return language_config(cfg) if isinstance(cfg, dict) else None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"no exported draft at {shown_path(path.parent)}: run `serve export` first")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{shown_path(path)}: not valid JSON ({str(exc).splitlines()[0][:100]}); {_AGAIN}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{shown_path(path)}: not a JSON object; {_AGAIN}")
    return cfg


def _read_weights(path: Path) -> tuple[dict[str, list[int]], np.ndarray | None, np.ndarray | None]:
    """Every tensor's shape from the weights file's header, and its ``d2t`` and ``t2d`` (None for one
    it lacks); a file that is missing or whose header or vocabulary tensors cannot be read is one line
    naming it."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            shapes = {n: list(f.get_slice(n).get_shape()) for n in f.keys()}
            d2t, t2d = (f.get_tensor(n) if n in shapes else None for n in ("d2t", "t2d"))
            return shapes, d2t, t2d
    except FileNotFoundError:
        raise ConfigError(f"{shown_path(path)}: missing; {_AGAIN}") from None
    except (OSError, SafetensorError, TypeError, ValueError) as exc:  # TypeError: a dtype numpy lacks (bf16)
        raise ConfigError(f"{shown_path(path)}: unreadable ({str(exc).splitlines()[0][:100]}); {_AGAIN}") from None
