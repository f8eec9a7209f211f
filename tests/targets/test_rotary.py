"""The rotary the draft trains with equals the one vLLM serves it with (defect 1 of issue 11).

The draft's exported config.json is read the way vLLM reads it (transformers' config, then vLLM's
own ``patch_rope_parameters`` and ``get_rope``, as its Llama attention does), and vLLM's rotary is
applied to random queries and keys next to the draft's training-time rotary. MiniMax-M2 rotates
half of each head (``rotary_dim`` = head_dim / 2): before the fix the draft rotated all of it.
"""

from __future__ import annotations

import json

import pytest
import torch

from eaglenest.serve.export import draft_hf_config
from eaglenest.train.model import DraftFlags, Eagle3Draft, apply_rotary, draft_config

BASE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-6, vocab_size=512, max_position_embeddings=4096)
CASES = {
    # MiniMax-M2 as released: a legacy top-level rotary_dim, theta at the top level.
    "minimax_rotary_dim": dict(BASE, model_type="minimax_m2", rotary_dim=16, rope_theta=5e6,
                               num_local_experts=4, num_experts_per_tok=2),
    # transformers 5 style: rope_parameters with partial_rotary_factor.
    "partial_rope_parameters": dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.25}),
    "full_default": dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama3_scaling": dict(BASE, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}),
    # Qwen3 long-context (its model card's YaRN setting), transformers 5 style and legacy "type" key.
    "yarn_rope_parameters": dict(BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                        "original_max_position_embeddings": 1024}),
    "yarn_legacy_type": dict(BASE, rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 1024}),
    # gpt-oss: YaRN with its beta values and truncation off.
    "yarn_gpt_oss": dict(BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 128}),
}


def _vllm_rope(exported: dict, tmp_path):
    from transformers import AutoConfig
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import patch_rope_parameters

    (tmp_path / "config.json").write_text(json.dumps(exported))
    cfg = AutoConfig.from_pretrained(str(tmp_path))
    from vllm.config import VllmConfig, set_current_vllm_config

    patch_rope_parameters(cfg)
    with set_current_vllm_config(VllmConfig()):  # vLLM builds its custom ops inside a config context
        return get_rope(cfg.head_dim, max_position=cfg.max_position_embeddings,
                        rope_parameters=cfg.rope_parameters, is_neox_style=True, dtype=torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_rotary_equals_vllm_serving_rotary(case, tmp_path):
    target = CASES[case]
    cfg = draft_config(target, draft_vocab_size=64, layer_ids=(2, 4, 5), flags=DraftFlags())
    draft = Eagle3Draft(cfg)
    info = {"draft_config": cfg.to_dict(), "layer_ids": [2, 4, 5]}
    exported = draft_hf_config(info, target, dtype="float32")
    rope = _vllm_rope(exported, tmp_path)

    torch.manual_seed(0)
    T, h, kvh, d = 40, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions = torch.arange(T) * 37  # spread over the long range (scaled ropes differ there)
    q, k = torch.randn(T, h * d), torch.randn(T, kvh * d)
    vq, vk = rope.forward_native(positions, q.clone(), k.clone())

    cos, sin = draft.rotary_emb(torch.zeros(1, T, cfg.hidden_size), positions[None])
    dq, dk = apply_rotary(q.view(1, T, h, d).transpose(1, 2), k.view(1, T, kvh, d).transpose(1, 2), cos, sin,
                          draft.midlayer.self_attn.rotary_dim)
    dq, dk = dq.transpose(1, 2).reshape(T, h * d), dk.transpose(1, 2).reshape(T, kvh * d)
    assert torch.allclose(dq, vq, atol=1e-4, rtol=1e-4), (dq - vq).abs().max()
    assert torch.allclose(dk, vk, atol=1e-4, rtol=1e-4), (dk - vk).abs().max()
    if case == "minimax_rotary_dim":
        assert draft.midlayer.self_attn.rotary_dim == 16
        assert exported["rope_parameters"]["partial_rotary_factor"] == 0.5
        # The unrotated half passes through untouched, in training as in serving.
        assert torch.equal(dq.view(T, h, d)[..., 16:], q.view(T, h, d)[..., 16:])
