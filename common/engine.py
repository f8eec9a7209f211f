"""Build vLLM engines the same way in every stage (regeneration, capture, evaluation).

vLLM is imported lazily: importing eaglenest never pulls it in. On CPU, ``gpu_memory_utilization``
is the share of the NUMA node's RAM reserved for the KV cache, so the default is small; on CUDA it
is the share of device memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from eaglenest.errors import require
from eaglenest.hf import check_remote_code, is_refusal, refusal

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    #: Longest sequence (prompt + output) the engine accepts.
    max_model_len: int = 4096
    #: KV-cache share of RAM (CPU) or device memory (CUDA).
    memory_fraction: float = 0.15
    max_num_seqs: int = 64
    #: "auto" runs the target in its own checkpoint dtype (config.json), unlike vLLM's "auto", which
    #: would downcast an fp32 checkpoint to bf16. Regeneration, capture and serving then agree.
    dtype: str = "auto"
    #: Skip CUDA graphs / torch.compile: faster start, slower steps. On by default for small runs.
    enforce_eager: bool = True
    seed: int = 0
    #: Devices one engine spans (vLLM tensor parallelism), e.g. 8 for a large MoE target.
    tensor_parallel_size: int = 1


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def checkpoint_dtype(model: str) -> str:
    """The dtype a local checkpoint declares in config.json ("auto" if unknown or remote)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return "auto"
    cfg = json.loads(path.read_text())
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto").replace("torch.", "")
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


def engine_kwargs(cfg: EngineConfig, model: str = "", *, trust_remote_code: bool = False) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments; ``trust_remote_code`` is ``run.trust_remote_code``."""
    return {
        "max_model_len": cfg.max_model_len,
        "gpu_memory_utilization": cfg.memory_fraction,
        "max_num_seqs": cfg.max_num_seqs,
        "dtype": checkpoint_dtype(model) if cfg.dtype == "auto" else cfg.dtype,
        "enforce_eager": cfg.enforce_eager,
        "seed": cfg.seed,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "trust_remote_code": trust_remote_code,
    }


def make_llm(model: str, cfg: EngineConfig, *, trust_remote_code: bool = False, **extra: Any):
    """A ``vllm.LLM`` for ``model``; ``extra`` adds e.g. ``speculative_config``. A local checkpoint
    that needs its own code is refused before the engine starts unless ``trust_remote_code``."""
    check_remote_code(model, trust_remote_code=trust_remote_code)
    require("vllm", "cpu" if not has_cuda() else "cuda")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    from vllm import LLM

    kwargs = {**engine_kwargs(cfg, model, trust_remote_code=trust_remote_code), **extra}
    log.info("starting vLLM engine for %s", model)
    try:
        return LLM(model=model, **kwargs)
    except ValueError as exc:  # a hub checkpoint with its own code: vLLM reads its config in process
        if trust_remote_code or not is_refusal(exc):
            raise
        raise refusal(model) from None


def close_llm(llm) -> None:
    """Stop an engine's background processes now rather than at interpreter exit."""
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort; process exit cleans up as well
        log.debug("engine shutdown raised", exc_info=True)
