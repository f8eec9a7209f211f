"""QA 12 of ``serve export``: DFlash checkpoints from before its bias-free MLP, and the positions a
DFlash draft is exported with (vLLM sizes its rotary from them and, unlike EAGLE-3's, never raises them)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglenest.errors import StoreError
from eaglenest.serve.export import export_draft
from eaglenest.target import max_positions
from eaglenest.train.checkpoint import FORMAT, WEIGHTS, weights_digest
from eaglenest.train.config import DFlashConfig, TrainConfig


def _old_checkpoint(ckpt, dest, *, bias_value: float):
    """``ckpt`` as a DFlash run from before its MLP was fixed bias-free wrote it: ``draft_config.mlp_bias``
    true (the target's) and a bias on each MLP projection."""
    dest.mkdir()
    info = json.loads((ckpt / "checkpoint.json").read_text())
    info["draft_config"]["mlp_bias"] = True
    state = load_file(str(ckpt / WEIGHTS))
    for name in [n for n in state if ".mlp." in n and n.endswith(".weight")]:
        state[name[: -len("weight")] + "bias"] = torch.full((state[name].shape[0],), bias_value)
    info["weights_sha256"] = weights_digest(state)  # the pair that run saved
    (dest / "checkpoint.json").write_text(json.dumps(info))
    save_file(state, str(dest / WEIGHTS), metadata={"format": FORMAT, "weights_sha256": info["weights_sha256"]})
    return dest


def test_an_old_dflash_checkpoint_with_trained_mlp_biases_is_refused(tmp_path, dflash_bias_checkpoint):
    """vLLM's DFlash layer (Qwen2MLP, no bias) loads such weights and drops the biases without a word: the
    draft served is not the one trained. The export refuses it in one line naming the checkpoint."""
    ckpt, target = dflash_bias_checkpoint
    old = _old_checkpoint(ckpt, tmp_path / "old run", bias_value=0.25)
    with pytest.raises(StoreError, match=r"old run.*MLP biases.*mlp_bias.*train the draft again") as err:
        export_draft(old, tmp_path / "draft", target_dir=target, off_policy=True)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "draft").exists()


def test_an_old_dflash_checkpoint_with_zero_mlp_biases_exports_without_them(tmp_path, dflash_bias_checkpoint):
    """All-zero biases compute nothing: dropping them serves exactly what was trained."""
    ckpt, target = dflash_bias_checkpoint
    old = _old_checkpoint(ckpt, tmp_path / "old", bias_value=0.0)
    out = export_draft(old, tmp_path / "draft", target_dir=target, off_policy=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        gate = f.get_tensor("layers.0.mlp.gate_proj.weight")
    assert not [n for n in names if n.endswith(".bias")]
    assert torch.equal(gate, load_file(str(ckpt / WEIGHTS))["layers.0.mlp.gate_proj.weight"])


@pytest.fixture(scope="module")
def long_target(tmp_path_factory, synth):
    """A target whose config.json leaves ``max_position_embeddings`` to its class (Mistral's 131072
    positions), and a DFlash checkpoint of it."""
    work = tmp_path_factory.mktemp("long")
    target = synth.make_target(work / "long target")
    cfg = json.loads((target / "config.json").read_text())
    del cfg["max_position_embeddings"]
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (target / "config.json").write_text(json.dumps(cfg))
    train = TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=1, block_size=3))
    return synth.untrained_checkpoint(train, target, work / "train"), target


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_a_dflash_draft_covers_every_position_its_target_serves(tmp_path, long_target, fmt):
    """vLLM sizes the DFlash draft's rotary cache from its ``max_position_embeddings`` and, as it does for
    EAGLE-3 drafts only, does not raise it to the target's length: a draft config without the key loads
    with Qwen3's 32768 and a long prompt would read past the cache. The export writes the target's length."""
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    ckpt, target = long_target
    want = max_positions(json.loads((target / "config.json").read_text()))[0]
    assert want == 131072  # Mistral's default, vLLM's length for this target
    out = export_draft(ckpt, tmp_path / "draft", target_dir=target, off_policy=True, format=fmt)
    if fmt == "vllm":
        loaded = AutoConfig.from_pretrained(out)
    else:
        loaded = SpeculatorsConfig.from_pretrained(out)  # vLLM's reader: transformer_layer_config + dflash keys
    assert loaded.max_position_embeddings == want
