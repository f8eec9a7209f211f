"""``common.engine.engine_kwargs``: what every engine the project starts is given."""

from __future__ import annotations

import json
import os

import pytest

from eaglenest.engine import CPU_THREAD_ENV, EngineConfig, cpu_all_cores, engine_kwargs, has_cuda
from eaglenest.errors import ConfigError
from eaglenest.featurestore.config import FeaturestoreConfig


def _checkpoint(path, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.skipif(has_cuda(), reason="the backend choice is for CPU engines")
def test_a_float32_mla_target_gets_the_reference_cpu_mla_backend(tmp_path):
    """vLLM prefers its AMX MLA backend on CPUs with AMX, and that backend refuses float32 weights
    at engine start (it failed the DeepSeek-V3 suite on such a machine): a float32 MLA checkpoint
    is started on CPU_MLA; anything else is left to vLLM."""
    mla = _checkpoint(tmp_path / "mla", dtype="float32", kv_lora_rank=512)
    nested = _checkpoint(tmp_path / "nested", torch_dtype="float32", text_config={"kv_lora_rank": 512})
    llama = _checkpoint(tmp_path / "llama", dtype="float32")
    bf16 = _checkpoint(tmp_path / "bf16", dtype="bfloat16", kv_lora_rank=512)
    assert engine_kwargs(EngineConfig(), mla)["attention_backend"] == "CPU_MLA"
    assert engine_kwargs(EngineConfig(), nested)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in engine_kwargs(EngineConfig(), llama)
    assert "attention_backend" not in engine_kwargs(EngineConfig(), bf16)
    assert "attention_backend" not in engine_kwargs(EngineConfig(dtype="bfloat16"), mla)
    assert "attention_backend" not in engine_kwargs(EngineConfig(), str(tmp_path / "missing"))


def test_cpu_all_cores_reach_the_engine_core_through_vllms_reserved_cores(monkeypatch):
    """``engine.cpu_all_cores`` reserves no core for vLLM's frontend while the engine core is
    spawned (vLLM reads VLLM_CPU_NUM_OF_RESERVED_CPU there), and nothing after; off, or a user's own
    binding, leaves vLLM's environment alone."""
    for k in (*CPU_THREAD_ENV, "VLLM_CPU_ATTN_SPLIT_KV"):
        monkeypatch.delenv(k, raising=False)
    with cpu_all_cores(True):  # and one summation order per query, whatever the threads
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "0"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ and "VLLM_CPU_ATTN_SPLIT_KV" not in os.environ
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "1")  # a user's choice is kept
    with cpu_all_cores(True):
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "1"
    assert os.environ["VLLM_CPU_ATTN_SPLIT_KV"] == "1"
    monkeypatch.delenv("VLLM_CPU_ATTN_SPLIT_KV")
    with pytest.raises(RuntimeError):  # undone when the engine fails to start too
        with cpu_all_cores(True):
            raise RuntimeError("engine failed")
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    with cpu_all_cores(False):
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    with cpu_all_cores(True):
        assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ


def test_where_an_engine_runs_and_what_is_refused():
    """null: in process on CPU with one rank; vLLM's own processes on CUDA or with tensor
    parallelism. An in-process engine of several ranks, or an in-process capture engine (its
    connector hands states over in the engine's next step), is refused before anything starts."""
    assert not EngineConfig().uses_own_process(cuda=False)
    assert EngineConfig().uses_own_process(cuda=True)
    assert EngineConfig(tensor_parallel_size=2).uses_own_process(cuda=False)
    assert EngineConfig(in_process=False).uses_own_process(cuda=False)
    assert not EngineConfig(in_process=True).uses_own_process(cuda=True)
    with pytest.raises(ConfigError, match=r"x\.in_process: an engine of 2 ranks needs its own processes"):
        EngineConfig(in_process=True, tensor_parallel_size=2).check("x")
    with pytest.raises(ConfigError, match=r"featurestore\.engine\.in_process: capture runs its engine"):
        FeaturestoreConfig(engine=EngineConfig(in_process=True))
    assert FeaturestoreConfig(engine=EngineConfig(in_process=False)).engine.in_process is False


def test_a_max_model_len_past_the_targets_positions_is_one_line(tiny_target):
    """vLLM refuses it in its config check (a pydantic traceback before); now one ConfigError naming
    the key and the target's limit, before any weight is loaded."""
    from eaglenest.engine import make_llm

    limit = json.loads((tiny_target / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"engine\.max_model_len: {limit + 8} is more than .* has positions for "
                                          rf"\(max_position_embeddings={limit}") as info:
        make_llm(str(tiny_target), EngineConfig(max_model_len=limit + 8, memory_fraction=0.05))
    assert "\n" not in str(info.value)
