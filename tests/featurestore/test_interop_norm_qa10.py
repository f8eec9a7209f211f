"""SpecForge's ``hidden_state`` is after the target's final norm: for a target whose RMSNorm scales by
(1 + weight) (Qwen3-Next, Qwen3.5) the conversion must apply that norm, not a plain x_hat * weight."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from eaglenest.featurestore.interop.specforge import apply_norm, final_norm


def _target(tmp_path, model_type: str, weight: torch.Tensor, eps: float):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": weight.numel(),
                                                "rms_norm_eps": eps}))
    save_file({"model.norm.weight": weight}, str(d / "model.safetensors"))
    return d


def test_a_zero_centred_final_norm_is_applied_as_the_model_applies_it(tmp_path):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(0)
    weight, eps = torch.randn(16, generator=g) * 0.1, 1e-6
    x = torch.randn(5, 16, generator=g) * 3
    norm = Qwen3NextRMSNorm(16, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        want = norm(x)
    got = apply_norm(x, *final_norm(str(_target(tmp_path, "qwen3_next", weight, eps))))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a Llama norm of the same stored weight is x_hat * weight: another tensor
    plain = apply_norm(x, *final_norm(str(_target(tmp_path, "llama", weight, eps))))
    assert not torch.allclose(plain, want, atol=1e-3)
    x_hat = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    torch.testing.assert_close(plain, x_hat * weight, rtol=1e-5, atol=1e-6)
