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
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eaglenest.errors import ConfigError
from eaglenest.paths import user_path

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


def check_target(target: str | Path) -> None:
    """Raise a :class:`ConfigError` naming ``run.target`` when it names a local path that is not a
    model directory (no such directory, or no ``config.json`` in it). A hub id (``name`` or
    ``namespace/name``) is left to transformers."""
    text = str(target)
    root = user_path(text, "run.target", error=ConfigError, resolve=False)  # a NUL, ~nosuchuser, a loop: one line
    if root.exists():
        if not root.is_dir() or not (root / "config.json").is_file():
            raise ConfigError(f"run.target: {text} is not a model directory (no config.json in it)")
        try:  # a broken config.json fails here, not in transformers' loader after outputs were started
            cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError(f"run.target: {text}/config.json is not valid JSON "
                              f"({str(exc).splitlines()[0][:120]})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"run.target: {text}/config.json is not a JSON object (not a model directory)")
        return
    if root.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1:
        raise ConfigError(f"run.target: {text}: no such directory (a local Hugging Face model directory, "
                          "or a hub id namespace/name)")


def check_remote_code(target: str | Path, *, trust_remote_code: bool) -> None:
    """Raise a :class:`ConfigError` if ``target`` is not a model (:func:`check_target`), or needs
    its own code and the run does not allow it."""
    check_target(target)
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

    return _load(AutoTokenizer.from_pretrained, target, trust_remote_code)


def load_config(target: str | Path, *, trust_remote_code: bool):
    from transformers import AutoConfig

    return _load(AutoConfig.from_pretrained, target, trust_remote_code)


def load_causal_lm(target: str | Path, *, trust_remote_code: bool, **kwargs):
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM.from_pretrained, target, trust_remote_code, **kwargs)


def _load(loader, target, trust_remote_code: bool, **kwargs):
    check_remote_code(target, trust_remote_code=trust_remote_code)
    try:
        return loader(str(target), trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as exc:  # transformers' refusal for a hub checkpoint with custom code
        if trust_remote_code or not is_refusal(exc):
            raise
        raise refusal(target) from None


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


def _known_tokenizer(name) -> bool:
    if not isinstance(name, str) or not name:
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(name) is not None
    except Exception:  # noqa: BLE001 - a name transformers cannot resolve is not one it has
        return False
