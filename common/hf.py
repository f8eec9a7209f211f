"""Load a target's tokenizer, config and model from Hugging Face with the run's ``trust_remote_code``.

Every stage loads the target through these helpers (and starts engines through
:func:`eaglenest.engine.make_llm`), so ``run.trust_remote_code`` reaches every loader and engine.
A checkpoint that ships its own Python classes (``auto_map`` in ``config.json`` or
``tokenizer_config.json``, as Kimi-K2 does) needs that code run to load at all; with the flag off it
is refused with one line naming ``run.trust_remote_code=true`` rather than a transformers traceback.

Trade-off: a local directory is checked before anything loads (so an engine is never started only
to fail in its worker), but a hub id is only known to need remote code once transformers says so,
which then becomes the same one-line error. ``auto_map`` entries whose class transformers already
has (its own ``model_type`` / ``tokenizer_class``) are not counted: transformers uses its own class
there, and so does vLLM.

A local directory is also checked for what every engine and loader needs before one starts: a
``model_type`` and ``architectures`` the installed transformers or vLLM knows (importing vLLM's
registry only when transformers does not), a tokenizer vocabulary file, and weight files (every
safetensors file as long as its header says). What transformers itself then refuses (a config.json
of ``num_attention_heads: 0``, a string for a size, a ``rope_scaling`` of the wrong shape: a
ZeroDivisionError, TypeError or KeyError from deep inside it) is one line naming ``run.target`` too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.paths import shown_path, user_path
from eaglenest.target import local_dir, missing_revision, pinned_revision

log = logging.getLogger(__name__)

#: Why the flag is off by default, said in every refusal.
WHY_OFF = ("off by default because it runs Python code shipped with the checkpoint; "
           "set it only for checkpoints you trust")


def remote_code_needed(target: str | Path) -> list[str]:
    """What in a local checkpoint needs its own Python code (empty: nothing, or not a local dir)."""
    root = Path(target)
    if not root.is_dir():
        return []
    found = []
    cfg = _read_json(root / "config.json")
    auto = cfg.get("auto_map") if isinstance(cfg.get("auto_map"), dict) else {}
    if "AutoConfig" in auto and not _known_model_type(cfg.get("model_type")):
        found.append(f"config.json auto_map AutoConfig -> {auto['AutoConfig']}")
    tcfg = _read_json(root / "tokenizer_config.json")
    tauto = tcfg.get("auto_map")
    if isinstance(tauto, (list, tuple)):  # the old form: [slow class, fast class]
        tauto = {"AutoTokenizer": list(tauto)}
    if isinstance(tauto, dict) and "AutoTokenizer" in tauto and not _known_tokenizer(tcfg.get("tokenizer_class")):
        found.append(f"tokenizer_config.json auto_map AutoTokenizer -> {_first(tauto['AutoTokenizer'])}")
    return found


def check_target(target: str | Path, *, key: str = "run.target", label: str = "") -> None:
    """Raise a :class:`ConfigError` naming ``key`` when ``target`` names a local path that is not a
    model directory (no such directory, no ``config.json`` in it, an unknown architecture, no
    tokenizer, missing shards, no or truncated weights), or a bare name that is neither a directory
    here nor cached. A hub id ``namespace/name`` is left to transformers. ``key``: what the caller's
    user typed the target as (``run.target``, a command's ``--model``), named by every refusal as
    ``key: target`` (``label``: another way the command names it, ``--target DIR``)."""
    text = str(target)
    label = label or f"{key}: {text}"
    root = user_path(text, key, error=ConfigError, resolve=False)  # a NUL, ~nosuchuser, a loop: one line
    if root.exists():
        if not root.is_dir() or not (root / "config.json").is_file():
            raise ConfigError(f"{label} is not a model directory (no config.json in it)")
        try:  # a broken config.json fails here, not in transformers' loader after outputs were started
            cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError(f"{label}/config.json is not valid JSON "
                              f"({str(exc).splitlines()[0][:120]})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{label}/config.json is not a JSON object (not a model directory)")
        if "speculators_config" in cfg or "speculators_model_type" in cfg:
            return  # a speculators-format draft: vLLM serves it with the verifier (and tokenizer) it names
        _check_model_type(label, cfg)
        _check_architectures(label, cfg)
        _check_tokenizer(label, root)
        _check_shards(label, root)
        _check_weights(label, root)
        return
    if root.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1:
        raise ConfigError(f"{label}: no such directory (a local Hugging Face model directory, "
                          "or a hub id namespace/name)")
    # A bare name is mostly a relative directory looked for from another directory; a hub id of one
    # part (legacy repos) is accepted only from the local cache, as docs/targets.md says.
    # So is namespace/name whose namespace is a directory here (models/qwen3 with a typo in qwen3): as a
    # hub id it would be fetched for a minute of retries, after the stage made its store.
    revision = pinned_revision(text)
    cached = (local_dir(text) / "config.json").is_file()
    if ("/" not in text or root.parent.is_dir()) and not cached:
        if revision:
            raise missing_revision(text, revision)
        raise ConfigError(f"{label}: no such directory in the current directory ({Path.cwd()}) and "
                          "no hub model of that name in the local cache (a relative path is read from the current "
                          "directory)")
    if revision and not cached and _offline():  # transformers' own error names neither the id nor the revision
        raise missing_revision(text, revision)


def revision_kwargs(target: str | Path) -> dict[str, str]:
    """The keyword arguments that make ``vllm.LLM`` read ``target`` at its pinned revision
    (``run.target_revision``; ``eaglenest.target.pinned_revision``): its weights and config, tokenizer and own
    code (``run.trust_remote_code``); {} when none is pinned (the cache's main). ``vllm serve`` takes each as
    ``--revision``, ``--tokenizer-revision``, ``--code-revision``."""
    revision = pinned_revision(target)
    return {key: revision for key in ("revision", "tokenizer_revision", "code_revision")} if revision else {}


def _offline() -> bool:
    """Whether Hugging Face loaders may not reach the hub (``HF_HUB_OFFLINE``): only the cache counts."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_remote_code(target: str | Path, *, trust_remote_code: bool, key: str = "run.target") -> None:
    """Raise a :class:`ConfigError` if ``target`` is not a model (:func:`check_target`, naming ``key``),
    or needs its own code and the run does not allow it."""
    check_target(target, key=key)
    if trust_remote_code:
        return
    needed = remote_code_needed(target)
    if needed:
        raise refusal(target, needed[0])


def refusal(target: str | Path, what: str = "") -> ConfigError:
    """The one-line error for a target that needs its own code while ``run.trust_remote_code`` is off."""
    return ConfigError(f"run.trust_remote_code: {target} ships its own code{f' ({what})' if what else ''}; "
                       f"set run.trust_remote_code=true to load it ({WHY_OFF})")


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is transformers' (or vLLM's, which is transformers') custom-code refusal."""
    return isinstance(exc, ValueError) and "trust_remote_code" in str(exc)


def load_tokenizer(target: str | Path, *, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return _load(AutoTokenizer.from_pretrained, target, trust_remote_code, what="config or tokenizer")


def load_config(target: str | Path, *, trust_remote_code: bool, key: str = "run.target"):
    from transformers import AutoConfig

    return _load(AutoConfig.from_pretrained, target, trust_remote_code, what="config or tokenizer", key=key)


def load_causal_lm(target: str | Path, *, trust_remote_code: bool, **kwargs):
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM.from_pretrained, target, trust_remote_code, what="model", **kwargs)


def _load(loader, target, trust_remote_code: bool, *, what: str = "files", key: str = "run.target", **kwargs):
    """``loader(target)``; what it refuses is one :class:`ConfigError` naming ``key`` and ``what``
    it was loading (a config.json transformers refuses raises ZeroDivisionError, TypeError, ...)."""
    check_remote_code(target, trust_remote_code=trust_remote_code, key=key)
    revision = pinned_revision(target)  # run.target_revision: a hub id at another revision than the cache's main
    try:
        return loader(str(target), trust_remote_code=trust_remote_code, **({"revision": revision} if revision else {}),
                      **kwargs)
    except (EaglenestError, ImportError, MemoryError):  # already one line; a missing package or memory: not the target
        raise
    except OSError as exc:  # a hub id neither in the local cache nor reachable (no network, no such repo)
        if Path(target).is_dir():
            raise
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        if revision:
            raise ConfigError(f"run.target_revision: {revision}: {target} cannot be loaded at that revision "
                              f"({first}); a branch, tag or commit of it, or empty for the cache's main") from None
        raise ConfigError(f"{key}: {target}: no such directory in the current directory ({Path.cwd()}), "
                          f"and not loadable as a hub id ({first})") from None
    except Exception as exc:  # noqa: BLE001 - a config.json transformers refuses raises anything (ZeroDivisionError)
        if is_refusal(exc) and not trust_remote_code:  # transformers' refusal for a hub checkpoint with custom code
            raise refusal(target) from None
        if "out of memory" in str(exc).lower():
            raise
        raise ConfigError(f"{key}: {shown_path(target)}: transformers cannot load its {what} "
                          f"({_first_line(exc)}); compare its files with the original checkpoint's") from None


def check_generation_config(target: str | Path, *, key: str = "run.target") -> None:
    """A local target's ``generation_config.json`` as vLLM reads it when an engine starts (transformers'
    ``GenerationConfig``, whose stop tokens and defaults it applies): a value transformers refuses
    (``max_new_tokens: -5``) was a ValueError traceback from the engine's start, and a file that is no
    JSON was skipped without a word (the checkpoint's extra stop tokens lost). One line naming ``key`` and the file."""
    path = Path(target) / "generation_config.json"
    if not path.is_file():
        return
    from transformers import GenerationConfig

    try:
        if not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
            raise TypeError("it holds no JSON object")
        GenerationConfig.from_pretrained(str(target))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:  # UnicodeDecodeError: a ValueError
        raise ConfigError(f"{key}: {shown_path(path)} is refused ({_first_line(exc)}); fix the value it names, "
                          "or remove the file (the engine then stops at the tokenizer's end token only)") from None


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters), for one-line errors."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])[:200]}" if lines else type(exc).__name__


#: Files that hold a tokenizer's vocabulary (``*.model``: sentencepiece or tiktoken, ``tekken.json``: Mistral's).
TOKENIZER_GLOBS = ("tokenizer.json", "tekken.json", "vocab.json", "vocab.txt", "*.model", "*.tiktoken")


def _check_model_type(label: str, cfg: dict) -> None:
    """Refuse a config.json whose ``model_type`` neither transformers nor vLLM knows, unless it ships
    its own config class (``auto_map``, checked by :func:`check_remote_code`): vLLM would fail at
    engine start and transformers on loading, each with a traceback."""
    auto = cfg.get("auto_map")
    if isinstance(auto, dict) and "AutoConfig" in auto:
        return
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures")
    named = f" (architectures: {', '.join(map(str, archs))})" if isinstance(archs, list) and archs else ""
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"{label}/config.json has no model_type{named}; a Hugging Face config names "
                          "its architecture family there")
    if not _known_model_type(model_type) and not _known_to_vllm(model_type):
        raise ConfigError(f"{label}/config.json: model_type {model_type!r}{named} is not one the "
                          "installed transformers or vLLM knows (a newer release, or a checkpoint with its own "
                          "code and auto_map)")


def _check_architectures(label: str, cfg: dict) -> None:
    """Refuse a config.json whose ``architectures`` name no class transformers or vLLM has (unless it
    ships its own code): vLLM's refusal is a traceback listing its few hundred classes."""
    archs = cfg.get("architectures")
    if isinstance(cfg.get("auto_map"), dict):
        return
    if not isinstance(archs, list) or not archs:  # vLLM then runs it as a pooling model: every chat request fails
        hint = _causal_lm_class(cfg.get("model_type"))
        add = f'add "architectures": ["{hint}"], or ' if hint else ""
        raise ConfigError(f"{label}/config.json has no architectures list (the model class vLLM runs); "
                          f"{add}download the checkpoint's config.json again")
    names = [a for a in archs if isinstance(a, str) and a]
    if len(names) != len(archs):  # vLLM looks each up by name: a number or null is a TypeError once it starts
        raise ConfigError(f"{label}/config.json: architectures must be model class names, got "
                          f"{json.dumps(archs)[:120]}; download the checkpoint's config.json again")
    if not any(_known_architecture(a) for a in names):
        raise ConfigError(f"{label}/config.json: architectures {', '.join(names)} is no model class the "
                          "installed transformers or vLLM has (a typo, or a checkpoint needing a newer release)")


def _check_tokenizer(label: str, root: Path) -> None:
    """Refuse a model directory with no tokenizer vocabulary file (ingest, capture and evaluation all
    tokenize with it; transformers' own error lists three ways to build one)."""
    if not any(next(root.glob(pattern), None) for pattern in TOKENIZER_GLOBS):
        raise ConfigError(f"{label} has no tokenizer (none of {', '.join(TOKENIZER_GLOBS)}); "
                          "copy the checkpoint's tokenizer files into it")
    # Truncated, the tokenizers library raises a bare Exception from inside every loader (tokenizer.json),
    # and transformers a JSONDecodeError traceback (tokenizer_config.json).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = root / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError(f"{label}/{name} is not valid JSON "
                              f"({str(exc).splitlines()[0][:120]}); download it again") from None


def _check_shards(label: str, root: Path) -> None:
    """Refuse sharded weights whose index is unreadable or names a shard that is not there (an
    interrupted download): vLLM finds that only after its engine started, as a traceback."""
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        return
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ConfigError(f"{label}/{index.name} has no weight_map of tensor names to files; "
                          "download the checkpoint again")
    missing = sorted(f for f in set(weight_map.values()) if not (root / f).is_file())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConfigError(f"{label}: {index.name} names weight files that are not there "
                          f"({', '.join(missing[:3])}{more}); the download was interrupted? download them again")


#: Weight files vLLM loads from a model directory (its load format "auto": safetensors, else PyTorch files).
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def _check_weights(label: str, root: Path) -> None:
    """Refuse a model directory with no weight file, or with a safetensors file shorter than its own
    header says (an interrupted download, or a Git LFS pointer from a clone without git-lfs): vLLM
    finds either only after its engine started, as a traceback, and after the store was made."""
    files = sorted({p for pattern in WEIGHT_GLOBS for p in root.glob(pattern) if p.is_file()})
    if not files:
        raise ConfigError(f"{label} has no weights (none of {', '.join(WEIGHT_GLOBS)}); "
                          "copy the checkpoint's weight files into it")
    index = _read_json(root / "model.safetensors.index.json").get("weight_map")
    if isinstance(index, dict):  # vLLM loads only the shards the index names (not a consolidated.safetensors)
        files = sorted({root / name for name in index.values()})
    for path in files:
        problem = _safetensors_problem(path) if path.suffix == ".safetensors" else ""
        if problem:
            raise ConfigError(f"{label}/{path.name} {problem}; download it again")


def _safetensors_problem(path: Path) -> str:
    """What is wrong with a safetensors file's framing ("" if nothing), from its header alone: an
    8-byte little-endian header length, a JSON header, then the tensors' bytes up to the largest
    ``data_offsets`` end."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                return f"is not a safetensors file ({size:,} bytes; truncated, or a Git LFS pointer?)"
            header = json.loads(f.read(length))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "has a damaged header"
    need = 8 + length + max(ends, default=0)
    if size < need:
        return f"is truncated ({size:,} of {need:,} bytes)"
    return ""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _first(value) -> str:
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if v), "")
    return str(value)[:120]


def _known_model_type(model_type) -> bool:
    from transformers import CONFIG_MAPPING

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _known_architecture(name: str) -> bool:
    """Whether transformers or vLLM has a model class of this name (vLLM's registry only on a miss)."""
    import transformers

    try:
        if hasattr(transformers, name):
            return True
    except (ImportError, RuntimeError):  # transformers has it, but its module needs a missing extra
        return True
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return False
    return name in ModelRegistry.get_supported_archs()


def _causal_lm_class(model_type) -> str:
    """transformers' causal-LM class for ``model_type`` ("" if it has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    return name if isinstance(name, str) else ""


def _known_to_vllm(model_type: str) -> bool:
    """Whether vLLM registers its own config class for ``model_type`` (Kimi-K2, ChatGLM, ...)."""
    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    except ImportError:
        return False
    return model_type in _CONFIG_REGISTRY


def _known_tokenizer(name) -> bool:
    if not isinstance(name, str) or not name:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(name) is not None
    except Exception:  # noqa: BLE001 - a name transformers cannot resolve is not one it has
        return False
