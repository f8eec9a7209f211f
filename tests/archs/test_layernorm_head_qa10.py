"""A final norm with a bias is a LayerNorm (mean-centred: StableLM, OPT, Pythia, Phi-2, Falcon): the trainer's
RMSNorm target head would train against other logits than the target's, so it is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.errors import ConfigError
from eaglenest.train.target import load_target_tensors


def _target(tmp_path, norm_bias: bool, norm_name: str = "model.norm"):
    h, v = 8, 32
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "stablelm", "hidden_size": h, "vocab_size": v,
                                                      "num_hidden_layers": 2, "tie_word_embeddings": False}))
    tensors = {"model.embed_tokens.weight": torch.randn(v, h), "lm_head.weight": torch.randn(v, h),
               f"{norm_name}.weight": torch.ones(h)}
    if norm_bias:
        tensors[f"{norm_name}.bias"] = torch.zeros(h)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_final_norm_with_a_bias_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"final norm 'model\.norm\.weight' has a bias \('model\.norm\.bias'\): "
                                          r"a LayerNorm"):
        load_target_tensors(_target(tmp_path, norm_bias=True))


def test_a_final_norm_without_a_bias_loads(tmp_path):
    out = load_target_tensors(_target(tmp_path, norm_bias=False))
    assert out["keys"]["norm"] == "model.norm.weight"
    torch.testing.assert_close(out["norm"], torch.ones(8))


def test_only_the_tensors_asked_for_are_checked(tmp_path):
    """A caller reading only the embedding (the draft's input embedding) does not use the norm."""
    out = load_target_tensors(_target(tmp_path, norm_bias=True), only=("embed",))
    assert tuple(out["embed"].shape) == (32, 8)
