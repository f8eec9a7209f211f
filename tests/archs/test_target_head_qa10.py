"""Target heads that scale their logits (hostile pass 10): the trainer's target head (``load_target_tensors``'s
final norm and lm_head) gives the target's own logits, for Granite (logits / ``logits_scaling``), Cohere2-MoE
(logits * ``logit_scale``), MiniCPM3 (normed hidden states / (hidden_size / ``dim_model_base``)), HyperCLOVA X
(logits * ``logits_scaling``) and Falcon-H1 (logits * ``lm_head_multiplier``), each built with transformers' own
class (random init, offline). The trainer read the plain lm_head, so its soft targets had another temperature
than the target's (16x too sharp for Granite-3's 16).
Heads it does not model (a LayerNorm final norm, a soft cap, a scale key on another model type) are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.errors import ConfigError
from eaglenest.train import target as T
from eaglenest.train.target import load_target_tensors

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _config(kind: str, **scale):
    from transformers import AutoConfig

    extra = {"granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64),
             "cohere2_moe": dict(rms_norm_eps=1e-5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                 tie_word_embeddings=True),
             "minicpm3": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16),
             "granitemoehybrid": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                                      mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
                                      mamba_chunk_size=16, layer_types=["mamba", "attention"]),
             "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                               mamba_chunk_size=16),
             }.get(kind, {})
    small = {k: v for k, v in SMALL.items() if not (kind == "minicpm3" and k == "head_dim")}
    return AutoConfig.for_model(kind, **small, **extra, **scale)


# (model type, its scale key and a value that is not 1, the scalar on the logits that value means, from
# transformers' forward: granite divides, cohere multiplies, minicpm3 divides the hidden states by 64 / 16)
CASES = [("granite", {"logits_scaling": 8.0}, 1 / 8), ("granitemoeshared", {"logits_scaling": 4}, 1 / 4),
         ("granitemoehybrid", {"logits_scaling": 6}, 1 / 6),  # Granite 4 (Mamba-2 layers beside attention)
         ("cohere2_moe", {"logit_scale": 0.25}, 0.25), ("minicpm3", {"dim_model_base": 16}, 16 / 64),
         ("hyperclovax", {"logits_scaling": 0.5}, 0.5), ("falcon_h1", {"lm_head_multiplier": 0.3}, 0.3)]
#: Falcon-H1's final norm is ``model.final_layernorm``: named with run.target_keys.norm.
NORM = {"falcon_h1": "final_layernorm"}


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def target(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    kind, scale, factor = request.param
    out = tmp_path_factory.mktemp(kind) / "target"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(kind, **scale), dtype=torch.float32).save_pretrained(str(out))
    state = load_file(str(out / "model.safetensors"))  # a trained final norm: not its initial weights
    noise = torch.randn(SMALL["hidden_size"], generator=torch.Generator().manual_seed(1)) * 0.1
    norm = f"model.{NORM.get(kind, 'norm')}.weight"
    state[norm] = state[norm] + noise
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, kind, factor


def _logits_and_norm_input(path, kind=""):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seen = {}
    norm = getattr(model.model, NORM.get(kind, "norm"))
    norm.register_forward_hook(lambda m, args, out: seen.__setitem__("x", args[0][0].clone()))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 100, 200, 7, 31]])).logits[0]
    return logits, seen["x"], model


def _ours(head, x):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head["rms_norm_eps"]) * head["norm"]) @ head["lm_head"].T


def test_the_trainer_target_head_gives_the_target_logits_of_a_scaled_head(target):
    path, kind, factor = target
    logits, x, model = _logits_and_norm_input(path, kind)
    head = load_target_tensors(path, keys={"norm": f"model.{NORM[kind]}.weight"} if kind in NORM else None)
    assert json.loads((path / "config.json").read_text())["model_type"] == kind
    assert torch.allclose(_ours(head, x), logits, atol=1e-4, rtol=1e-4), (_ours(head, x) - logits).abs().max()
    # The scale is the one transformers applies, not 1: the plain head is off by exactly that factor.
    plain = _ours({**head, "lm_head": model.lm_head.weight.detach()}, x)
    assert torch.allclose(plain * factor, logits, atol=1e-4, rtol=1e-4) and factor != 1
    # A tied embedding (Cohere2-MoE ties them) is the draft's input: it keeps the checkpoint's values.
    assert torch.equal(head["embed"], model.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("kind, key, default", [("cohere2_moe", "logit_scale", 0.0625),
                                                ("minicpm3", "dim_model_base", 256),
                                                ("granite", "logits_scaling", 1.0)])
def test_a_scale_config_json_leaves_out_takes_the_config_class_default(tmp_path, kind, key, default):
    """A config.json without the key gets transformers' default (Cohere's 1/16, MiniCPM3's 256), not 1."""
    from transformers import AutoModelForCausalLM

    assert getattr(_config(kind), key) == default
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    logits, x, _ = _logits_and_norm_input(tmp_path)
    assert torch.allclose(_ours(load_target_tensors(tmp_path), x), logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "cohere", "logit_scale": 0.0625}, "cohere model whose final norm is a LayerNorm"),
    ({"model_type": "cohere2"}, "cohere2 model whose final norm is a LayerNorm"),
    ({"model_type": "cohere2_moe", "rms_norm_eps": None}, "cohere2_moe model whose final norm is a LayerNorm"),
    ({"model_type": "nanochat", "final_logit_softcapping": 15.0}, "soft-caps its logits"),
    ({"model_type": "llama", "logit_scale": 2.0}, "sets logit_scale=2.0"),
    ({"model_type": "qwen3", "logits_scaling": 4}, "sets logits_scaling=4"),
    ({"model_type": "granite", "logits_scaling": 0}, "logits_scaling: a number > 0, got 0"),
    ({"model_type": "granitemoe", "logits_scaling": None}, "logits_scaling: a number > 0, got None"),
])
def test_a_head_the_trainer_does_not_model_is_refused_in_one_line(tmp_path, cfg, words):
    """Refused from config.json alone, before any weight is read (the folder has none)."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "hidden_size": 64, **cfg}))
    with pytest.raises(ConfigError) as e:
        load_target_tensors(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("cfg", [{"model_type": "llama"}, {"model_type": "llama", "logit_scale": 1.0},
                                 {"model_type": "qwen3", "final_logit_softcapping": None},
                                 {"model_type": "minicpm"}])
def test_a_plain_head_is_left_as_it_is(cfg):
    assert T.logit_scale({"hidden_size": 64, **cfg}, "/models/x") == 1.0
