"""``common.engine.engine_kwargs``: what every engine the project starts is given."""

from __future__ import annotations

import json

import pytest

from eaglenest.engine import EngineConfig, engine_kwargs, has_cuda


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
