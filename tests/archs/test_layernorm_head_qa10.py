"""A final norm with a bias is a LayerNorm (mean-centred: StableLM, OPT, Pythia, Phi-2, Falcon): the trainer's
RMSNorm target head would train against other logits than the target's, so it is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eaglenest.errors import ConfigError
from eaglenest.train.target import load_target_tensors


def _tensors(norm_bias: bool, norm_name: str = "model.norm") -> dict:
    """Distinct random values in each tensor (a trained norm, not its initial ones), so a tensor read from
    the wrong name, or not read at all, differs from the one saved."""
    h, v = 8, 32
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
               "lm_head.weight": torch.randn(v, h, generator=g), f"{norm_name}.weight": 1 + torch.randn(h, generator=g)}
    if norm_bias:
        tensors[f"{norm_name}.bias"] = torch.zeros(h)
    return tensors


def _target(tmp_path, norm_bias: bool, norm_name: str = "model.norm"):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "stablelm", "hidden_size": 8, "vocab_size": 32,
                                                      "num_hidden_layers": 2, "tie_word_embeddings": False}))
    save_file(_tensors(norm_bias, norm_name), str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_final_norm_with_a_bias_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"final norm 'model\.norm\.weight' has a bias \('model\.norm\.bias'\): "
                                          r"a LayerNorm"):
        load_target_tensors(_target(tmp_path, norm_bias=True))


def test_a_final_norm_without_a_bias_loads(tmp_path):
    out = load_target_tensors(_target(tmp_path, norm_bias=False))
    assert out["keys"] == {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
                           "lm_head": "lm_head.weight"}
    for kind, name in out["keys"].items():  # the saved values, unscaled (a StableLM head has no logit scale)
        assert torch.equal(out[kind], _tensors(False)[name]), kind


def test_only_the_tensors_asked_for_are_checked(tmp_path):
    """A caller reading only the embedding (the draft's input embedding) does not use the norm."""
    out = load_target_tensors(_target(tmp_path, norm_bias=True), only=("embed",))
    assert torch.equal(out["embed"], _tensors(True)["model.embed_tokens.weight"])
    assert "norm" not in out and "lm_head" not in out
