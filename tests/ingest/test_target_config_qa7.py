"""Seventh QA pass on the target checks `ingest build` (and every engine start) runs before anything is
written: a config.json whose values transformers reads but cannot build a model from (an activation or
rotary type no library has, zero key-value heads) went through to vLLM, which refused it once its engine
started (a ValueError traceback, after the store folder was made). Refused now in one line naming
run.target. No engine starts here: reaching vLLM fails the test."""

from __future__ import annotations

import json

import pytest

from eaglenest.engine import EngineConfig, make_llm
from eaglenest.errors import ConfigError
from eaglenest.ingest.commands import check_target_loads
from eaglenest.shapes import config_shapes


@pytest.mark.parametrize(("changes", "says"), [
    ({"hidden_act": "swiglu"}, "KeyError: 'swiglu'"),  # vLLM: "Unsupported activation: swiglu" at engine start
    ({"num_key_value_heads": 0}, "ZeroDivisionError"),
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "nosuch"}}, "KeyError: 'nosuch'"),
])
def test_a_config_no_model_can_be_built_from_is_refused_before_any_engine(no_vllm, changes, says, config_target):
    target = config_target(**changes)
    with pytest.raises(ConfigError) as exc:
        check_target_loads(str(target), trust_remote_code=False, max_model_len=256)
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"run.target: {target}/config.json: transformers cannot build")
    assert says in line
    with pytest.raises(ConfigError, match=r"^featurestore\.engine\.max_model_len|^run\.target: "):
        make_llm(str(target), EngineConfig(max_model_len=256), where="featurestore.engine")


def test_a_config_transformers_has_no_causal_lm_class_for_is_still_left_to_vllm(config_target):
    """Only a model transformers has a class for and fails to build is refused: a config it has no
    causal-LM class for (a vision-language wrapper, a vLLM-only architecture) is not judged here."""
    target = config_target(hidden_act="silu")
    assert config_shapes(target) is not None
    vl = config_target("vl")
    cfg = json.loads((vl / "config.json").read_text())
    wrapper = {"model_type": "qwen3_vl", "architectures": ["Qwen3VLForConditionalGeneration"],
               "text_config": {**cfg, "model_type": "qwen3_vl_text"}}
    (vl / "config.json").write_text(json.dumps(wrapper))
    assert config_shapes(vl) is None
