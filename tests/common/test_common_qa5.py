"""QA pass 5 on the shared layer: weights of other shapes than config.json makes, refused before an engine
loads them, naming run.target and the tensor (vLLM cut a larger checkpoint tensor to fit without a word
and served another model)."""

from __future__ import annotations

import shutil

import pytest

import eaglenest.precheck
from eaglenest.engine import EngineConfig, make_llm
from eaglenest.errors import ConfigError
from eaglenest.shapes import check_weight_shapes, mismatches


@pytest.mark.parametrize(("changes", "says"), [
    # Both started an engine that served the checkpoint cut to config.json's shapes (no error at all).
    ({"intermediate_size": 256}, "model.layers.0.mlp.down_proj.weight is [128, 384] in model.safetensors, "
                                 "config.json makes it [128, 256]; and 23 more tensors"),
    ({"num_key_value_heads": 2}, "model.layers.0.self_attn.k_proj.weight is [128, 128] in model.safetensors, "
                                 "config.json makes it [64, 128]; and 15 more tensors"),
    ({"vocab_size": 1024}, "lm_head.weight is [2048, 128] in model.safetensors, config.json makes it [1024, 128]"),
])
def test_a_checkpoint_larger_than_config_json_is_refused_before_the_engine(no_vllm, changes, says, config_target):
    target = config_target(**changes)
    with pytest.raises(ConfigError) as info:
        make_llm(str(target), EngineConfig(max_model_len=128, memory_fraction=0.05, in_process=True))
    message = str(info.value)
    assert message.startswith(f"run.target: {target}: weights do not match config.json ({says}")
    assert "\n" not in message


def test_the_checkpoint_as_released_passes(tiny_target):
    check_weight_shapes(tiny_target)  # raises on any mismatch


def test_a_hub_id_or_a_folder_without_safetensors_is_left_to_the_engine(config_target):
    check_weight_shapes("org/not-here")  # no local folder: nothing to compare
    bin_only = config_target(intermediate_size=256)
    (bin_only / "model.safetensors").rename(bin_only / "pytorch_model.bin")  # no header to read
    check_weight_shapes(bin_only)


def test_a_quantised_checkpoint_is_not_compared(config_target):
    """Packed quantised tensors keep their names with other shapes: never taken for an edit."""
    target = config_target(intermediate_size=256,
                           quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    check_weight_shapes(target)


def test_only_tensors_of_both_with_another_element_count_are_named():
    have = {"a": ("x.safetensors", [4, 8]), "b": ("x.safetensors", [8, 4]), "c": ("y.safetensors", [3]),
            "only_in_checkpoint": ("y.safetensors", [1])}
    want = {"a": [4, 8], "b": [4, 8], "c": [5], "only_in_model": [2]}
    assert mismatches(have, want) == ["c is [3] in y.safetensors, config.json makes it [5]"]


def test_vllms_own_shape_failure_still_names_the_target(monkeypatch, config_target):
    """Where the comparison cannot run (no transformers class for it), vLLM's loader failure is still one
    line naming run.target (``engine_errors``): the pre-check turned off here to reach it. Starts an engine."""
    monkeypatch.setattr(eaglenest.precheck, "check_weight_shapes", lambda target, **kwargs: None)
    target = config_target(intermediate_size=512)
    with pytest.raises(ConfigError) as info:
        make_llm(str(target), EngineConfig(max_model_len=128, memory_fraction=0.05, in_process=True))
    message = str(info.value)
    assert message.startswith(f"run.target: {target}: weights do not match config.json (")
    assert "exceeds dimension size (384)" in message and "\n" not in message


# -- the weights' identity (featurestore/capture/identity.py::weights_hash; not this area's file) -----------
def test_two_targets_differing_only_in_weights_get_different_hashes(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file

    from eaglenest.featurestore.capture.identity import weights_hash

    other = tmp_path / "other"
    shutil.copytree(tiny_target, other)
    state = load_file(str(other / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    assert weights_hash(str(other)) != weights_hash(str(tiny_target))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_target, copy)
    assert weights_hash(str(copy)) == weights_hash(str(tiny_target))  # the folder's name is not the weights
