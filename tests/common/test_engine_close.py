"""``common.engine``: a real engine stops within its short grace and leaves no process (vLLM's own
processes), and an engine in this process starts without them and leaves the process as it was."""

from __future__ import annotations

import gc
import os
import random
import time

import numpy as np
import pytest
import torch

from eaglenest.engine import ENGINE_STOP_GRACE_S, EngineConfig, close_llm, make_llm

#: vLLM's default grace took 4.50-4.78 s per close on this project's 2-core machine
#: (bench/engine_close.py); ``close_llm``'s 1 s grace took 1.01 s.
BOUND_S = 3.5
SMALL = {"max_model_len": 256, "max_num_seqs": 2, "memory_fraction": 0.1}


def _engine_processes():
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]


def _decode(llm) -> list[list[int]]:
    from vllm import SamplingParams

    out = llm.generate(["one two three", "a b c"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


@pytest.mark.slow
def test_close_llm_stops_the_engine_within_its_grace_and_leaves_no_process(tiny_target):
    import psutil

    assert ENGINE_STOP_GRACE_S < BOUND_S
    llm = make_llm(str(tiny_target), EngineConfig(**SMALL, in_process=False))
    try:
        assert [len(t) for t in _decode(llm)] == [8, 8]  # both prompts answered (all() of none passed)
        engine = _engine_processes()
        assert len(engine) >= 2, engine  # the EngineCore and its worker
    except BaseException:
        close_llm(llm)
        raise
    t0 = time.monotonic()
    close_llm(llm)
    took = time.monotonic() - t0
    _, alive = psutil.wait_procs(engine, timeout=30)
    assert took < BOUND_S, f"close_llm took {took:.2f} s (grace {ENGINE_STOP_GRACE_S} s)"
    assert not alive, f"engine processes left after close_llm: {alive}"


@pytest.mark.slow
def test_in_process_engine_starts_no_process_and_leaves_this_one_as_it_was(tiny_target):
    """An engine in this process (CPU's default; asked for here, so CUDA runs the same check): no
    engine process; the same tokens as vLLM's own processes; and once it has started,
    ``torch.set_num_threads`` works, the random generators are where they were, the garbage
    collector's heap is not frozen and vLLM's environment variables are read afresh. (Which engines
    run in process by default: tests/common/test_engine_kwargs.py.)"""
    from vllm import envs

    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    llm = make_llm(str(tiny_target), EngineConfig(**SMALL, in_process=True))
    try:
        assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
        assert torch.set_num_threads is set_threads and gc.get_freeze_count() == 0
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "3"  # read afresh, not from the value cached at engine start
        try:
            assert envs.VLLM_CPU_KVCACHE_SPACE == 3
        finally:
            del os.environ["VLLM_CPU_KVCACHE_SPACE"]
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ or os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0"
        assert not _engine_processes()
        tokens = _decode(llm)
        assert [len(t) for t in tokens] == [8, 8]  # else the comparison below compares two empty lists
    finally:
        close_llm(llm)
    assert torch.get_num_threads() == threads
    own = make_llm(str(tiny_target), EngineConfig(**SMALL, in_process=False))
    try:
        assert _engine_processes() and _decode(own) == tokens
    finally:
        close_llm(own)
