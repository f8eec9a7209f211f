"""Will the longest sample fit in memory? Estimates checked before any engine or trainer starts.

Long context makes the largest single unit of work (the longest conversation captured, the
trainer's packed row, evaluate's longest context bucket) the thing that runs a machine out of
memory, minutes into a run and after an engine took tens of seconds to start. Each stage calls
:func:`require_fit` with an :class:`Estimate` of what that unit needs, before anything starts, and
a recipe that cannot fit is refused with one line: the estimate, the memory available and the key
to change.

The trade-off: estimates, not measurements. They are deliberately low (they count what the unit
itself needs: weights, its KV cache and hidden-state slots, the activations it keeps for backward,
the captured tensors in flight; not the engine's fixed KV reservation, allocator slack or other
processes), so a recipe that runs today is never refused; a refusal means the unit cannot fit
even by this lower bound. Every input is a plain number (the stage passes its config's values),
so this module imports no stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.target import language_config, read_config

_DTYPE_BYTES = {"float32": 4, "float": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
                "float8_e4m3fn": 1, "fp8": 1}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What one unit of work needs: ``parts`` (name -> bytes), what it is, and the key that shrinks it."""

    what: str
    key: str
    parts: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return int(sum(self.parts.values()))


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def available_bytes() -> int:
    """Memory a new process can use now: ``MemAvailable`` on Linux, else the physical total."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: never refuse


def require_fit(est: Estimate, *, available: int | None = None) -> None:
    """Raise :class:`ConfigError` (one line: key, estimate, its largest parts, memory available)
    when ``est`` exceeds the memory available (``available``: given, else :func:`available_bytes`)."""
    avail = available_bytes() if available is None else int(available)
    if est.total_bytes <= avail:
        return
    big = sorted(est.parts.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{name} {gib(n)}" for name, n in big)
    raise ConfigError(f"{est.key}: {est.what} needs about {gib(est.total_bytes)} ({parts}), more than the "
                      f"{gib(avail)} of memory available; lower {est.key}")


def dtype_bytes(name: str, default: int = 2) -> int:
    return _DTYPE_BYTES.get(str(name).replace("torch.", ""), default)


def target_dims(cfg: dict, *, engine_dtype: str = "auto", target: str = "") -> dict[str, int]:
    """The sizes the estimates need, from a target's (language) ``config.json`` mapping; a size that
    is missing or not a positive whole number is a :class:`ConfigError` naming ``run.target`` and the key."""
    where = f"run.target: {target}/config.json" if target else "run.target: config.json"

    def size(key: str, default: int | None = None) -> int:
        return _size(cfg, key, default, where=where)

    hidden = size("hidden_size")
    heads = size("num_attention_heads", 1)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    return {"layers": size("num_hidden_layers"), "hidden": hidden, "heads": heads,
            "head_dim": size("head_dim", hidden // heads),
            "kv_heads": size("num_key_value_heads", heads),
            "intermediate": size("intermediate_size", 4 * hidden),
            "vocab": size("vocab_size", 32000),
            "dtype_bytes": dtype_bytes(dtype if engine_dtype == "auto" else engine_dtype),
            "checkpoint_dtype_bytes": dtype_bytes(dtype)}


def _size(cfg: dict, key: str, default: int | None, *, where: str) -> int:
    """``cfg[key]`` as a size (``default`` where it is missing, null or 0, as transformers fills it)."""
    value = cfg.get(key) or default
    if value is None:
        raise ConfigError(f"{where}: {key} is missing (a size every engine and estimate needs)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {key} must be a whole number >= 1, got {short(value)}")
    return value


def weights_bytes(target: str, dims: dict[str, int]) -> int:
    """A local target's safetensors bytes, else a dense estimate from ``dims`` (a lower bound for MoE).
    With a ``model.safetensors.index.json``, only the files its weight map names count: vLLM loads
    those alone, and a folder may also hold the same weights as ``consolidated.safetensors``."""
    files = list(Path(target).glob("*.safetensors")) if Path(target).is_dir() else []
    loaded = _indexed_files(Path(target) / "model.safetensors.index.json") if files else set()
    if loaded:
        files = [f for f in files if f.name in loaded]
    if files:
        # An engine dtype narrower than the checkpoint's (float32 served in bfloat16) holds that share of
        # the files; a wider one is not counted (the files' size stays a lower bound).
        on_disk, loaded_as = dims.get("checkpoint_dtype_bytes", dims["dtype_bytes"]), dims["dtype_bytes"]
        return sum(f.stat().st_size for f in files) * min(loaded_as, on_disk) // on_disk
    h, d = dims["hidden"], dims["head_dim"]
    per_layer = h * d * (2 * dims["heads"] + 2 * dims["kv_heads"]) + 3 * h * dims["intermediate"]
    return (dims["layers"] * per_layer + 2 * dims["vocab"] * h) * dims["dtype_bytes"]


def _indexed_files(index: Path) -> set[str]:
    """The file names a safetensors index's weight map points to (empty without a readable index)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {str(name) for name in weight_map.values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return set()


def engine_parts(dims: dict[str, int], *, tokens: int, weights: int, capture_layers: int = 0,
                 batched_tokens: int = 8192) -> dict[str, int]:
    """A vLLM engine running one sequence of ``tokens``: weights, its KV cache (plus the
    ``extract_hidden_states`` slots of ``capture_layers`` layers), the activations of one prefill
    chunk (at most ``batched_tokens``)."""
    b = dims["dtype_bytes"]
    kv = 2 * dims["layers"] * dims["kv_heads"] * dims["head_dim"] * b
    chunk = min(tokens, batched_tokens)
    parts = {"weights": weights, "kv_cache": tokens * kv,
             "prefill_activations": chunk * (4 * dims["hidden"] + 2 * dims["intermediate"]) * b}
    if capture_layers:
        parts["hidden_state_slots"] = tokens * capture_layers * dims["hidden"] * b
    return parts


def capture_estimate(dims: dict[str, int], *, tokens: int, weights: int, capture_layers: int,
                     stored_bytes_per_token: int, key: str) -> Estimate:
    """``featurestore capture`` of one conversation of ``tokens``: the engine's share, and the
    captured tensor held three times on the way to the table (read back, encoded row, Arrow table;
    ``capture/writer.py``)."""
    parts = engine_parts(dims, tokens=tokens, weights=weights, capture_layers=capture_layers)
    parts["captured_rows"] = 3 * tokens * max(stored_bytes_per_token,
                                              capture_layers * dims["hidden"] * dims["dtype_bytes"])
    return Estimate(f"capturing the longest conversation ({tokens} tokens)", key, parts)


def train_estimate(*, pack_tokens: int, rows: int, hidden: int, num_aux: int, heads: int, head_dim: int,
                   intermediate: int, draft_vocab: int, target_vocab: int, ttt_steps: int,
                   attn_chunk_tokens: int, target_chunk_tokens: int, key: str = "train.pack_tokens",
                   slots: int = 0, layers: int = 1, context_queries: bool = True) -> Estimate:
    """One optimizer step of an EAGLE-3-family draft on ``rows`` packed rows of ``pack_tokens``
    (fp32 training): the batch's features, the target distribution over the draft vocabulary,
    and per TTT step the activations kept for backward and the draft logits (twice, logits and
    log-probabilities, unless the loss is chunked: ``target_chunk_tokens``); attention scores and
    their softmax (kept for backward; TTT step k also attends to k diagonal keys) are dense [T, T]
    per head and step up to ``attn_chunk_tokens``, one query chunk at a time beyond.

    ``slots``: the query slots per row a parallel family adds (P-EAGLE: anchors x (num_slots - 1);
    DFlash: anchors x block_size), attended densely together with the row's ``pack_tokens`` context
    keys, never chunked; ``context_queries=False`` when the context positions are keys only (DFlash).
    ``layers``: the draft's decoder layers (DFlash may have several)."""
    f = 4
    pos = rows * pack_tokens
    q_row = (pack_tokens if context_queries else 0) + slots
    k_row = pack_tokens + slots
    queries = rows * q_row
    parts = {"features": pos * (num_aux + 1) * hidden * f,
             "target_distribution": pos * draft_vocab * f
             + min(pos, target_chunk_tokens or pos) * target_vocab * f,
             "step_activations": ttt_steps * layers * queries * (10 * hidden + 3 * intermediate + 4 * heads * head_dim)
             * f,
             "draft_logits": ttt_steps * queries * draft_vocab * f}
    if not (target_chunk_tokens and pos > target_chunk_tokens):
        parts["draft_log_probs"] = parts["draft_logits"]
    if slots or pack_tokens <= attn_chunk_tokens:
        parts["attention_scores"] = ttt_steps * layers * rows * heads * q_row * k_row * f
        diagonal = 0 if slots else ttt_steps * (ttt_steps - 1) // 2
        parts["attention_probs"] = layers * rows * heads * q_row * (ttt_steps * k_row + diagonal) * f
    else:
        parts["attention_scores"] = rows * heads * attn_chunk_tokens * pack_tokens * f
    what = f"{ttt_steps} TTT steps" if not slots else f"{slots} query slots per row, {layers} layer(s)"
    return Estimate(f"a training step of {rows} row(s) of {pack_tokens} tokens (hidden {hidden}, {what})", key, parts)


def check_engine(target: str, *, tokens: int, engine_dtype: str, key: str, what: str = "",
                 capture_layers: int = 0, stored_bytes_per_token: int = 0) -> None:
    """Refuse, before it starts, a vLLM engine on ``target`` that cannot hold one sequence of
    ``tokens`` (``what`` it is for, ``key`` the recipe key to change); with ``capture_layers`` the
    capture's share too, under :func:`capture_estimate`'s own description. A hub target (no local
    config) is not estimated."""
    cfg = load_target_config(target)
    if cfg is None:
        return
    dims = target_dims(cfg, engine_dtype=engine_dtype, target=target)
    weights = weights_bytes(target, dims)
    if capture_layers:
        est = capture_estimate(dims, tokens=tokens, weights=weights, capture_layers=capture_layers,
                               stored_bytes_per_token=stored_bytes_per_token, key=key)
    else:
        est = Estimate(what, key, engine_parts(dims, tokens=tokens, weights=weights))
    require_fit(est)


def load_target_config(target: str) -> dict | None:
    """A local target's language config (a multimodal wrapper's text config), else None (a hub
    id: nothing is estimated, the stage's own checks apply)."""
    if not (Path(target) / "config.json").is_file():
        return None
    try:
        return language_config(read_config(target))
    except ConfigError:
        return None
