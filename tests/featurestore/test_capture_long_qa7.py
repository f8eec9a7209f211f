"""Seventh QA pass on `featurestore capture` at the edge of a target's positions when its config.json
scales them (a linear rotary factor: vLLM takes max_position_embeddings x factor). No engine starts:
reaching it fails the test."""

from __future__ import annotations


import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture import build
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store
from eaglenest.precheck import check_max_model_len

import fs_helpers  # on sys.path via conftest


def test_a_response_that_filled_every_scaled_position_names_how_to_capture_it(tmp_path, monkeypatch, config_target):
    """A target of 10 positions x linear factor 2: vLLM (and ingest) run it up to 20 tokens, so `ingest
    build` at max_model_len 20 stores conversations of 20. Capture needs 21 and said only "raise it";
    raising it is refused as past the target's 20 positions: a dead end, the way out (the environment
    variable, named for an unscaled target) was left unsaid because max_position_embeddings (10) is not
    the 20 positions the conversation fills."""
    fs_helpers.forbid_capture_engine(monkeypatch)
    target = config_target("scaled target", max_position_embeddings=10,
                           rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match=r"21 is more than .* has positions for"):  # raising it: refused
        check_max_model_len(str(target), 21, where="featurestore.engine")
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.rows_of(20), target)
    cfg = FeaturestoreConfig(engine=EngineConfig(max_model_len=20, memory_fraction=0.1))
    with pytest.raises(ConfigError, match=r"^featurestore\.engine\.max_model_len: 20 is too small for prompts row "
                                          r"s-000 \(20 tokens; capture needs 21\): raise it; 21 is past the 20 "
                                          r"positions of run\.target .*scaled target, which vLLM allows with "
                                          r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment"):
        build.capture(target=str(target), store_uri=uri, cfg=cfg)
    assert not store.exists(uri, store.FEATURES)
    # a conversation of max_position_embeddings tokens, short of the scaled positions: the plain advice
    with pytest.raises(ConfigError, match=r"capture needs 11\): raise it$"):
        build.check_lengths(fs_helpers.rows_of(10), 10, target=str(target))
