"""The trainer's target head (``load_target_tensors``: the final norm and lm_head it reads) gives the
target's own logits, on a Llama-style target and on one whose RMSNorm scales by (1 + weight)
(Qwen3-Next, Qwen3.5: zero-centred weights). The trainer applied the stored weight as is, so its
"target distribution" for those had nothing to do with the target's (argmax agreeing at no position)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.tinytarget import archs
from eaglenest.train.target import load_target_tensors


def _qwen3_next(out):
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    ids = archs._tokenizer(out, ())
    cfg = Qwen3NextConfig(vocab_size=ids["vocab_size"], hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, intermediate_size=256, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                          linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
                          linear_value_head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def target(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "target"
    path = archs.build("qwen3", out) if request.param == "qwen3" else _qwen3_next(out)
    state = load_file(str(path / "model.safetensors"))  # a trained final norm: not its initial weights
    noise = torch.randn(128, generator=torch.Generator().manual_seed(1)) * 0.1
    state["model.norm.weight"] = state["model.norm.weight"] + noise
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_the_trainer_target_head_gives_the_target_logits(target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    seen = {}

    def keep(module, args, output) -> None:
        seen["x"] = args[0][0].clone()

    model.model.norm.register_forward_hook(keep)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 100, 200, 7, 31]])).logits[0]
    head = load_target_tensors(target)
    x = seen["x"]
    ours = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head["rms_norm_eps"]) * head["norm"]) @ head["lm_head"].T
    assert json.loads((target / "config.json").read_text())["model_type"] in ("qwen3", "qwen3_next")
    assert torch.allclose(ours, logits, atol=1e-4, rtol=1e-4), (ours - logits).abs().max()
