"""Mutation audit of the trainer's target head (honest-tests pass 11): a test that fails on a plausible mutant
the newest tests let through.

A scale key holding a bool (``"logit_scale": true``: a flag, not a scale) equals 1 in Python, so a check that
compares the value alone reads it as "no scale"; it is refused in one line, on a model type that scales its
logits and on one that does not. So is a soft cap of 0 (falsy, but a cap: not left out)."""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train.target import load_target_tensors, logit_scale


@pytest.mark.parametrize("cfg, words", [
    ({"model_type": "llama", "logit_scale": True}, "sets logit_scale=True"),
    ({"model_type": "qwen3", "logits_scaling": True}, "sets logits_scaling=True"),
    ({"model_type": "granite", "logits_scaling": True}, "logits_scaling: a number > 0, got True"),
    ({"model_type": "cohere2_moe", "rms_norm_eps": 1e-5, "logit_scale": True}, "logit_scale: a number > 0, got True"),
    # a cap of 0 is not "no cap": transformers divides the logits by it (tanh(x / 0) * 0: NaN)
    ({"model_type": "llama", "final_logit_softcapping": 0.0}, "soft-caps its logits (final_logit_softcapping=0.0)"),
])
def test_a_bool_scale_key_is_refused_not_read_as_one(tmp_path, cfg, words):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 256, "hidden_size": 64, **cfg}))
    with pytest.raises(ConfigError) as e:
        load_target_tensors(tmp_path)
    assert words in str(e.value) and "\n" not in str(e.value), e.value
    with pytest.raises(ConfigError):
        logit_scale({"hidden_size": 64, **cfg}, tmp_path)
