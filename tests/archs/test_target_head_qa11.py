"""A Granite-family or HyperCLOVA X config holding both ``logits_scaling`` and ``logit_scale`` (hostile pass 11):
the trainer's target head applies what transformers' class applies, ``logits_scaling`` alone (Granite divides,
HyperCLOVA X multiplies; neither reads ``logit_scale``), built with transformers' own class (random init,
offline). vLLM's Granite and HyperCLOVA X heads multiply by ``logit_scale`` too: the two disagree on such a
config, and the trainer follows transformers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_target_head_qa10 as Q  # noqa: E402  (the qa10 builders: same small configs, same head)

from eaglenest.train.target import load_target_tensors  # noqa: E402

# (model type, config keys, drop from config.json, the scalar transformers puts on lm_head(norm(h)))
CASES = [("granite", {"logits_scaling": 4.0, "logit_scale": 0.5}, None, 1 / 4),
         ("granitemoe", {"logits_scaling": 8, "logit_scale": 3.0}, None, 1 / 8),
         ("hyperclovax", {"logits_scaling": 0.25, "logit_scale": 2.0}, None, 0.25),
         # logit_scale alone: logits_scaling takes the config class's default (1.0), logit_scale nothing
         ("granite", {"logit_scale": 0.5}, "logits_scaling", 1.0)]


@pytest.mark.parametrize("kind, keys, drop, factor", CASES, ids=[f"{c[0]}-{'-'.join(c[1])}" for c in CASES])
def test_the_head_of_a_config_with_both_scale_keys_is_the_transformers_head(tmp_path, kind, keys, drop, factor):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Q._config(kind, **keys), dtype=torch.float32).save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert all(cfg[k] == v for k, v in keys.items()), cfg  # both keys reach config.json
    if drop:
        cfg.pop(drop)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(tmp_path / "model.safetensors"))  # a trained final norm, not its initial ones
    state["model.norm.weight"] = state["model.norm.weight"] + 0.1 * torch.randn(Q.SMALL["hidden_size"])
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    logits, x, model = Q._logits_and_norm_input(tmp_path)
    head = load_target_tensors(tmp_path)
    assert torch.allclose(Q._ours(head, x), logits, atol=1e-4, rtol=1e-4), (Q._ours(head, x) - logits).abs().max()
    plain = Q._ours({**head, "lm_head": model.lm_head.weight.detach()}, x)
    assert torch.allclose(plain * factor, logits, atol=1e-4, rtol=1e-4)  # logits_scaling alone, as transformers
