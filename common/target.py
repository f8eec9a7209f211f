"""What every stage needs to know about the target checkpoint's language model, from config.json.

Multimodal checkpoints (Qwen3-VL, Llama-4, Gemma-3, Mistral-3, Kimi-K2.5 style) nest the language
model's settings under ``text_config`` (InternVL-style ones under ``llm_config``); the draft, the
capture layer ids and the feature shapes all follow the language model, so they read
:func:`language_config`. Keys a wrapper keeps only at the top level (dtype, tied embeddings) are
filled in from there.

Also the target's safetensors weights by tensor name (:func:`weight_files`, :func:`open_weights`),
a damaged file or index being one line, for the stages that read a few of its tensors themselves.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator

from eaglenest.errors import ConfigError
from eaglenest.paths import read_json_object

#: Where wrappers keep the language model's config, in the order they are tried.
NESTED = ("text_config", "llm_config", "language_config")
_INHERITED = ("torch_dtype", "dtype", "tie_word_embeddings")
#: Model types whose final RMSNorm scales by (1 + weight) (zero-centred weights: Qwen3-Next, Qwen3.5). The
#: trainer's target head, the draft's norm and the SpecForge conversion are plain RMSNorms (x_hat * weight),
#: so they take 1 + the stored weight.
ZERO_CENTRED_NORM = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


#: The revision ``run.target_revision`` pins for a target named by hub id, in this process (target -> revision):
#: registered where a command resolves its recipe (``RunConfig.register_storage``, called by
#: ``eaglenest.launch.execute``), and read by every loader of the target (:func:`local_dir`, ``eaglenest.hf``'s
#: loaders, the engine's ``revision``), so none of them reads the cache's ``main`` instead.
_PINNED: dict[str, str] = {}


def pin_revision(target: str | Path, revision: str) -> None:
    """Make ``revision`` the one every loader in this process reads ``target`` at ("": the cache's main); a
    short commit id is written out (:func:`_written_out`)."""
    if revision:
        _PINNED[str(target)] = _written_out(str(target), revision)
    else:
        _PINNED.pop(str(target), None)


#: A commit id as git and the hub show it short (7 or more hex digits); a full one is 40.
_SHORT_COMMIT = re.compile(r"[0-9a-f]{7,39}")


def _written_out(target: str, revision: str) -> str:
    """``revision`` as the full commit of the one snapshot of ``target`` in the local Hugging Face cache that it
    abbreviates (7 or more hex digits, as the hub and git show one): transformers and vLLM take a full commit only,
    so a short one the cache holds was "no such revision" offline. As given otherwise (a branch or tag, a ref
    of that name, a full commit, none or several snapshots it abbreviates)."""
    if not _SHORT_COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:
        repo = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=target, repo_type="model")
        if (repo / "refs" / revision).is_file():  # a branch or tag of that name: the hub reads it first
            return revision
        found = [p.name for p in (repo / "snapshots").iterdir() if p.name.startswith(revision)]
    except (OSError, ValueError):  # no such folder, or no repo id
        return revision
    return found[0] if len(found) == 1 else revision


def pinned_revision(target: str | Path) -> str:
    """The revision pinned for ``target`` in this process (:func:`pin_revision`); "" when none is."""
    return _PINNED.get(str(target), "")


def missing_revision(target: str | Path, revision: str) -> ConfigError:
    """The one line for a ``run.target_revision`` the local Hugging Face cache does not hold (and, offline,
    cannot fetch)."""
    return ConfigError(f"run.target_revision: {revision}: {target} has no such revision in the local Hugging Face "
                       f"cache (a branch, tag or commit of it: fetch it with `hf download {target} --revision "
                       f"{revision}`, or leave run.target_revision empty for the cache's main)")


def local_dir(target: str | Path, *, revision: str | None = None) -> Path:
    """The directory holding ``target``'s files: ``target`` itself, or for a hub id (``namespace/name``)
    that is not a local path, its snapshot in the local Hugging Face cache when one is there: at
    ``revision`` (a branch, tag or commit; None: the one pinned, :func:`pinned_revision`, else ``main``)."""
    root = Path(target)
    if root.exists() or root.is_absolute() or str(target).startswith((".", "~")):
        return root
    from huggingface_hub import try_to_load_from_cache

    revision = pinned_revision(target) if revision is None else revision
    try:
        cached = try_to_load_from_cache(str(target), "config.json", revision=revision or None)
    except ValueError:  # not a repo id either
        return root
    return Path(cached).parent if isinstance(cached, str) else root


def read_config(target: str | Path, *, key: str = "run.target") -> dict[str, Any]:
    """``config.json`` of a local target directory (or a cached hub id's snapshot) as a dict; what is
    wrong with it is one line naming ``key`` (how the user gave the target)."""
    p = local_dir(target) / "config.json"
    if not p.is_file() and not Path(target).is_dir() and pinned_revision(target):
        raise missing_revision(target, pinned_revision(target))
    if not p.is_file():
        raise ConfigError(f"{key}: {target} has no config.json (a local Hugging Face model directory, "
                          "or a hub id in the local cache, is required)")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: {p} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{key}: {p} is not a JSON object (a Hugging Face config holds one)")
    return cfg


def language_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: ``cfg`` itself, or its nested text config with the
    wrapper's dtype and embedding tying filled in where the nested one does not say, then every
    other key it leaves out from transformers' class for it (:func:`_nested_defaults`)."""
    for key in NESTED:
        inner = cfg.get(key)
        if not isinstance(inner, dict):
            continue
        out = dict(inner)
        for k in _INHERITED:
            if out.get(k) is None and cfg.get(k) is not None:
                out[k] = cfg[k]
        out = {**_nested_defaults(cfg, key), **out}
        if "hidden_size" in out:
            return out
    return cfg


def nested_key(cfg: dict[str, Any]) -> str | None:
    """The key holding the language config of a wrapper (None for a plain causal LM)."""
    return next((k for k in NESTED if isinstance(cfg.get(k), dict)
                 and "hidden_size" in {**_nested_defaults(cfg, k), **cfg[k]}), None)


#: Keys of a nested text config the stages read (sizes; the rotary's, any of ``_ROPE``) which a config
#: written by transformers 4 leaves out when they equal its class's defaults.
_READ = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "max_position_embeddings")
_ROPE = ("rope_parameters", "rope_scaling", "rope_theta")


def _nested_defaults(cfg: dict[str, Any], key: str) -> dict[str, Any]:
    """transformers' config for the nested ``cfg[key]`` as a dict (None values left out; {} where
    transformers has no class for it or refuses it). Configs written by transformers 4 keep in a
    nested text config only the keys that differ from its class's defaults: LLaVA-1.5's says nothing
    of its 4096 hidden size or 32 layers, which transformers and vLLM take from ``LlamaConfig``."""
    inner = cfg[key]
    if all(k in inner for k in _READ) and any(k in inner for k in _ROPE):
        return {}  # written whole (transformers 5 does): nothing the stages read is left to a class
    try:
        from transformers import CONFIG_MAPPING

        if isinstance(inner.get("model_type"), str) and inner["model_type"] in CONFIG_MAPPING:
            built = CONFIG_MAPPING[inner["model_type"]](**inner)
        else:  # the wrapper's class picks its text model (LLaVA: Llama)
            built = getattr(CONFIG_MAPPING[cfg["model_type"]](**{key: inner}), key, None)
        built = built.to_dict()
    except Exception:  # noqa: BLE001 - no class, custom code, a value it refuses: the nested dict as written
        return {}
    return {k: v for k, v in built.items() if v is not None} if isinstance(built, dict) else {}


#: Rotary types whose ``max_position_embeddings`` is already the scaled length (vLLM applies no factor).
_SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def max_positions(cfg: dict[str, Any]) -> tuple[int, str] | None:
    """The longest ``max_model_len`` vLLM accepts for a target whose config.json is ``cfg``, as its
    ``_get_and_verify_max_len`` derives it: the language config's ``max_position_embeddings``, times
    the rotary ``factor`` of a scaling that does not already count it (``linear``, ``dynamic``; not
    YaRN, Llama-3 or LongRoPE, nor any Gemma-3). A config.json without ``max_position_embeddings``
    (nor another length key vLLM reads) has its transformers class's default, as vLLM reads it (2048
    for ``llama``). None where vLLM may allow more than that tells (a ``model_max_length`` key, no
    whole ``max_position_embeddings``, a factor that is no number): the engine judges those. The other
    limits vLLM applies (the tokenizer's, a sliding window) only lower it, so a length past this one is
    certainly refused. Returns the length and where it comes from (``max_position_embeddings=4096 x
    rotary factor 2.0``)."""
    text = language_config(cfg)
    positions = text.get("max_position_embeddings")
    if "model_max_length" in cfg or "model_max_length" in text:
        return None
    default = ""
    if positions is None and not any(k in text for k in _OTHER_LENGTHS):
        positions, default = _class_positions(text.get("model_type"))
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        return None
    factor = 1.0
    if "gemma3" not in str(cfg.get("model_type")):
        for rope in _rope_parameters(text):
            kind = rope.get("rope_type", rope.get("type", "default"))
            value = rope.get("factor")
            if kind in _SCALED_ALREADY or value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None
            factor = max(factor, float(value))
    how = f"{default}max_position_embeddings={positions}" + (f" x rotary factor {factor:g}" if factor != 1 else "")
    return int(positions * factor), how


#: The other keys vLLM takes a target's length from (the smallest of those set; ``derive_max_model_len_and_key``).
_OTHER_LENGTHS = ("n_positions", "max_seq_len", "seq_length", "max_target_positions", "max_sequence_length",
                  "max_seq_length", "seq_len")


def _class_positions(model_type: Any) -> tuple[int | None, str]:
    """``max_position_embeddings`` of transformers' config class for ``model_type``, the value vLLM runs a
    config.json without one at, and how to name it (``LlamaConfig's default ``); (None, "") if it has none."""
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[model_type]
        value = cls().max_position_embeddings
    except Exception:  # noqa: BLE001 - no class (custom code), or one without the key: the engine judges
        return None, ""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return (value, f"config.json has none: {cls.__name__}'s default ") if ok else (None, "")


def _rope_parameters(text: dict[str, Any]) -> list[dict[str, Any]]:
    """The rotary settings of a language config, ``rope_parameters`` and the older ``rope_scaling``
    (transformers merges them: either may carry the factor), one dict per layer type where nested."""
    found = []
    for rope in (text.get("rope_parameters"), text.get("rope_scaling")):
        if isinstance(rope, dict):
            nested = [v for v in rope.values() if isinstance(v, dict)]
            found += nested if nested and len(nested) == len(rope) else [rope]
    return found


__all__ = ["NESTED", "language_config", "local_dir", "max_positions", "missing_revision", "nested_key", "pin_revision",
           "pinned_revision", "read_config"]


#: The end of the one line for a target's weight file or index that cannot be read.
DAMAGED = "the target's weights are damaged or incomplete (an interrupted download?): download them again"


def weight_files(target_dir: Path, *, why: str = "") -> dict[str, Path]:
    """``{tensor name: file}`` of a local target: from its sharded index, else ``model.safetensors``;
    neither is one line (``why``: what needs them)."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json_object(index, error=ConfigError, then=DAMAGED).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
            raise ConfigError(f"run.target: {index} has no 'weight_map' of tensor names to files; {DAMAGED}")
        return {name: target_dir / f for name, f in wm.items()}
    single = target_dir / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"run.target: {target_dir} has no model.safetensors(.index.json){why}")
    with open_weights(single) as f:
        return {name: single for name in f.keys()}


@contextlib.contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    """``safe_open`` of one of the target's weight files; a missing, truncated or foreign file is one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (OSError, SafetensorError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        raise ConfigError(f"run.target: cannot read {path} ({first}); {DAMAGED}") from None
