"""SpecForge's ``hidden_state`` is after the target's final norm: for a target whose RMSNorm scales by
(1 + weight) (Qwen3-Next, Qwen3.5) the conversion must apply that norm, not a plain x_hat * weight."""

from __future__ import annotations

import importlib
import json

import pytest
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


#: (config model_type, the module of transformers holding its RMSNorm, the class): each zero-centred type.
ZERO_CENTRED = [("qwen3_next", "qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm"),
                ("qwen3_5_text", "qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm"),
                ("qwen3_5", "qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm"),  # a flat config of the wrapper's type
                ("qwen3_5_moe_text", "qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeRMSNorm")]


@pytest.mark.parametrize("model_type, module, cls", ZERO_CENTRED, ids=[z[0] for z in ZERO_CENTRED])
@pytest.mark.parametrize("eps, scale", [(1e-6, 3.0), (0.25, 0.3)], ids=["eps-1e-6", "eps-0.25"])
def test_a_zero_centred_final_norm_is_applied_as_the_model_applies_it(tmp_path, model_type, module, cls, eps, scale):
    """``eps`` 0.25 against hidden states of mean square ~0.09: the config's epsilon weighs on every value,
    so a norm that does not take it from config.json gives other values."""
    norm_cls = getattr(importlib.import_module(f"transformers.models.{module}"), cls)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(16, generator=g) * 0.1
    x = torch.randn(5, 16, generator=g) * scale
    norm = norm_cls(16, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
        want = norm(x)
    got = apply_norm(x, *final_norm(str(_target(tmp_path, model_type, weight, eps))))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # a Llama norm of the same stored weight is x_hat * weight: another tensor
    plain = apply_norm(x, *final_norm(str(_target(tmp_path, "llama", weight, eps))))
    assert not torch.allclose(plain, want, atol=1e-3)
    x_hat = x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    torch.testing.assert_close(plain, x_hat * weight, rtol=1e-5, atol=1e-6)


def test_a_bfloat16_hidden_state_is_normed_in_float32_and_cast_once(tmp_path):
    """The norm's sums in float32 (as the model's RMSNorm computes them), one cast to bfloat16 at the end:
    a norm computed in bfloat16 rounds the mean square and each product, and differs."""
    g = torch.Generator().manual_seed(1)
    weight = 1 + torch.randn(64, generator=g) * 0.1
    x = (torch.randn(6, 64, generator=g) * 5).to(torch.bfloat16)
    w, eps = final_norm(str(_target(tmp_path, "llama", weight, 1e-5)))
    got = apply_norm(x, w, eps)
    xf = x.float()
    want = (xf * (xf.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
