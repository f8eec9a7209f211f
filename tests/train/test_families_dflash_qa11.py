"""QA 11 of DFlash drafts on unusual targets: what is trained is what the installed vLLM serves."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from eaglenest.serve.export import export_draft
from eaglenest.train import dflash as D
from eaglenest.train.config import DFlashConfig, TrainConfig
from eaglenest.train.model import DraftFlags, draft_config


@pytest.mark.parametrize("attention_bias", [False, True])
def test_a_dflash_draft_of_a_target_with_mlp_biases_has_vllms_bias_free_mlp(attention_bias):
    """A target whose MLPs have biases (``mlp_bias: true``): the DFlash draft's Qwen3-style layers took
    the flag and trained biases on gate/up/down, which vLLM 0.32's DFlash layer (Qwen2MLP, no bias)
    drops without a word when it loads them (its loader ignores unexpected ``.bias`` tensors): served,
    not the MLP that was trained. The attention biases, which vLLM's DFlash attention has, stay."""
    target = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=4, rms_norm_eps=1e-6, max_position_embeddings=256, mlp_bias=True,
                  attention_bias=attention_bias, pad_token_id=0)
    cfg = draft_config(target, draft_vocab_size=16, layer_ids=(1, 2, 3), flags=DraftFlags())
    D.configure(cfg, DFlashConfig(num_layers=2, block_size=3), target)
    names = [n for n, _ in D.DFlashDraft(cfg).named_parameters()]
    assert not [n for n in names if ".mlp." in n and n.endswith(".bias")]
    assert sum(n.endswith("_proj.bias") and ".self_attn." in n for n in names) == (8 if attention_bias else 0)


def test_an_exported_dflash_draft_of_an_mlp_bias_target_holds_no_mlp_bias(tmp_path, synth):
    """End to end: a DFlash checkpoint of such a target exports weights vLLM loads whole."""
    target = synth.make_target(tmp_path / "target", mlp_bias=True)
    cfg = TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=1, block_size=3))
    ckpt = synth.untrained_checkpoint(cfg, target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=target, off_policy=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "layers.0.mlp.gate_proj.weight" in names and not [n for n in names if n.endswith(".bias")]
