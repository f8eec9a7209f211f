"""What vLLM's start-up failures mean: its refusals of a ``max_model_len`` past the target's positions,
of a ``max_num_seqs`` past the tokens it batches a step and of a KV cache too small for one sequence,
and a checkpoint whose weights do not fit its config.json. Pure text and traceback matching;
:func:`eaglenest.engine.make_llm` turns each into one line."""

from __future__ import annotations

import re
import traceback
from typing import Any


#: vLLM's refusal of a ``max_model_len`` past the target's positions (its ModelConfig validation).
TOO_LONG = re.compile(r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len \(([^)]*)\)")
#: vLLM's refusal of a KV cache that cannot hold one sequence of ``max_model_len`` (``kv_cache_utils``).
KV_TOO_SMALL = re.compile(r"\(([\d.]+) GiB KV cache is needed, which is larger than the available KV cache memory "
                          r"\(([\d.]+) GiB\)")
NO_KV_MEMORY = "No available memory for the cache blocks"
#: vLLM's refusal of more sequences a step than tokens a step (its SchedulerConfig validation).
TOO_MANY_SEQS = re.compile(r"max_num_batched_tokens \((\d+)\) must be greater than or equal to max_num_seqs "
                           r"\((\d+)\)")


def kv_cache_problem(message: str) -> str | None:
    """What vLLM's error ``message`` says of a KV cache too small for one sequence ("no KV cache", or
    "a 0.5 GiB KV cache where 3 GiB are needed"); None for any other error."""
    if NO_KV_MEMORY in message:
        return "no KV cache"
    found = KV_TOO_SMALL.search(message)
    return f"a {found[2]} GiB KV cache where {found[1]} GiB are needed" if found else None


#: vLLM's (and torch's) words for a checkpoint tensor of another shape than config.json makes its parameter.
WEIGHT_SHAPE = re.compile(r"Attempted to load weight \(|exceeds dimension size|size mismatch for |"
                          r"The size of tensor a \(\d+\) must match")


def weights_mismatch(exc: BaseException) -> bool:
    """Whether ``exc`` is vLLM failing to load a weight into a parameter of another shape: by its message,
    or, for the bare ``assert`` of vLLM's linear layers, by being raised inside a model's ``load_weights``."""
    if WEIGHT_SHAPE.search(str(exc)):
        return True
    if not isinstance(exc, AssertionError):
        return False
    return any(frame.name in ("load_weights", "weight_loader") for frame in traceback.extract_tb(exc.__traceback__))


def shown(model: str, extra: dict[str, Any]) -> str:
    """``model``, and the draft of ``extra``'s speculative config if there is one (either may be the one)."""
    spec = extra.get("speculative_config")
    draft = spec.get("model") if isinstance(spec, dict) else None
    return f"{model} (or its draft {draft})" if draft else model


def one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines)[:200]
