"""A local checkpoint's tensor shapes against the shapes its config.json makes, before an engine loads it.

vLLM's weight loaders narrow each checkpoint tensor into its parameter: a tensor larger than config.json
makes it (``intermediate_size`` or ``num_key_value_heads`` lowered in config.json) is silently cut to fit,
and the engine starts and serves another model; a smaller one fails deep in the loader. Here the
safetensors headers (shapes only, no tensor read) are compared with transformers' own model for
config.json, built on the meta device (no memory, no weights).

Trade-off: only tensors of the same name in both, with another number of elements, count: a checkpoint
transformers renames on load (fused MoE experts, old key prefixes), a quantised one, one in PyTorch
files, one transformers has no causal-LM class for or one that needs its own code is checked less or not
at all. Nothing is refused that is not certainly wrong; vLLM's own failures stay recognised
(``engine_errors``).
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

from eaglenest.errors import ConfigError
from eaglenest.target import language_config, read_config

log = logging.getLogger(__name__)


def checkpoint_shapes(root: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (file name, shape)} from the headers of the safetensors files vLLM would load
    (those the index names, else every ``*.safetensors``); a header that cannot be read adds nothing."""
    index = root / "model.safetensors.index.json"
    try:
        names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        names = None
    files = sorted(root / n for n in names) if names else sorted(root.glob("*.safetensors"))
    shapes: dict[str, tuple[str, list[int]]] = {}
    for path in files:
        try:
            with path.open("rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            shapes.update({k: (path.name, list(v["shape"])) for k, v in header.items() if k != "__metadata__"})
        except (OSError, ValueError, KeyError, TypeError, AttributeError, MemoryError):
            continue  # hf.check_target refuses a damaged file by name
    return shapes


def config_shapes(root: Path, *, key: str = "run.target") -> dict[str, list[int]] | None:
    """{parameter name: shape} of transformers' causal-LM model for ``root``'s config.json, built on the
    meta device; None where it cannot be built without the checkpoint's own code, or is quantised.
    A model transformers has a class for that fails on a value of config.json (:data:`BUILD_REFUSALS`:
    an activation or rotary type no library has, zero heads) is one line naming ``key``: vLLM refused
    the same config only once its engine started, with a traceback."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = None
    try:
        config = AutoConfig.from_pretrained(str(root), trust_remote_code=False)
        if _quantized(config):
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - no class for it, custom code: vLLM (and engine_errors) judge it
        if config is not None and isinstance(exc, BUILD_REFUSALS) and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            why = f"{type(exc).__name__}: {lines[0][:120]}" if lines else type(exc).__name__
            raise ConfigError(f"{key}: {root}/config.json: transformers cannot build its model ({why}), and vLLM "
                              "cannot either; restore the checkpoint's own config.json") from None
        log.debug("no transformers model for %s's config.json: its weight shapes are not checked", root,
                  exc_info=True)
        return None
    return {name: list(t.shape) for name, t in model.state_dict().items()}


#: What transformers' own model class raises on a config.json value no implementation takes: an unknown
#: name looked up (``hidden_act``, a rotary ``rope_type``: KeyError) or a size of zero divided by.
BUILD_REFUSALS = (KeyError, ZeroDivisionError)


def _quantized(config) -> bool:
    text = getattr(config, "text_config", None)
    return bool(getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None))


def mismatches(have: dict[str, tuple[str, list[int]]], want: dict[str, list[int]]) -> list[str]:
    """One phrase per tensor of both whose number of elements differs (a transposed layout is no edit)."""
    return [f"{name} is {have[name][1]} in {have[name][0]}, config.json makes it {want[name]}"
            for name in sorted(have.keys() & want.keys()) if math.prod(have[name][1]) != math.prod(want[name])]


#: A decoder layer's index in a tensor name, after the stack's prefix (``model.`` in ``model.layers.7.mlp...``).
_LAYER = re.compile(r"^(.*?)layers\.(\d+)\.")


def _missing_layers(have: dict[str, tuple[str, list[int]]], cfg: dict) -> str:
    """What config.json's ``num_hidden_layers`` asks beyond the layers the weights hold ("" if
    nothing): vLLM builds every layer it names (a typo's 80 for 8 takes minutes) and then fails on
    the weights they lack; transformers' model for it here would be as slow to build. Only weights
    with one stack of ``layers.N`` are judged (a vision tower's beside the decoder's could be taken
    for it), and more layers than config.json names (MTP layers) are not refused."""
    n = cfg.get("num_hidden_layers")
    stacks: dict[str, set[int]] = {}
    for m in filter(None, map(_LAYER.match, have)):
        stacks.setdefault(m[1], set()).add(int(m[2]))
    if len(stacks) != 1 or isinstance(n, bool) or not isinstance(n, int):
        return ""
    held = next(iter(stacks.values()))
    if n <= max(held) + 1:
        return ""
    return f"num_hidden_layers is {n}, the weights hold {max(held) + 1} layers (0..{max(held)})"


def check_weight_shapes(target: str | Path, *, key: str = "run.target") -> None:
    """Refuse a local checkpoint whose weights are of other shapes than its config.json makes: one
    :class:`ConfigError` line naming ``key`` (how the user gave the target) and the first tensor
    (nothing for a hub id)."""
    root = Path(target)
    if not (root / "config.json").is_file():
        return
    have = checkpoint_shapes(root)
    layers = _missing_layers(have, language_config(read_config(root))) if have else None
    if layers:
        raise ConfigError(f"{key}: {target}/config.json: {layers}; restore the checkpoint's own config.json, or "
                          "download the checkpoint again")
    want = config_shapes(root, key=key) if have else None
    found = mismatches(have, want) if want else []
    if found:
        more = f"; and {len(found) - 1} more tensors" if len(found) > 1 else ""
        raise ConfigError(f"{key}: {target}: weights do not match config.json ({found[0]}{more}); restore "
                          "the checkpoint's own config.json, or download the checkpoint again")
