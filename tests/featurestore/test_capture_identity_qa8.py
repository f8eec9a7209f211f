"""Eighth QA pass on `featurestore capture`: what a feature set's identity must tell apart. The
target's config.json turns its weights into hidden states (norm epsilon, rotary base, activation): an
edit of it with the same weights and tokenizer gave the same feature-set id, so a re-run appended rows
of other hidden states to the table the old config filled. The engine is a stub (named so) wherever
what is tested lies around it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, identity
from eaglenest.featurestore.capture.writer import FeatureWriter
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(commit_every=1, engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


def _meta(target, ids=("a", "b")) -> S.FeatureMeta:
    return build.feature_meta(str(target), [], "auto", sample_ids=list(ids), gen_params_ids=["g0"])


@pytest.mark.parametrize("change", [{"rms_norm_eps": 0.1}, {"rope_parameters": {"rope_theta": 500000.0,
                                                                               "rope_type": "default"}},
                                    {"hidden_act": "gelu"}])
def test_a_config_edit_that_changes_the_forward_is_another_feature_set(tiny_target, config_target, change):
    edited = _meta(config_target(**change))
    assert edited.feature_set_id != _meta(tiny_target).feature_set_id
    assert edited.identity_components["weights_sha256"] == _meta(tiny_target).identity_components["weights_sha256"]
    assert identity.differences(_meta(tiny_target).identity_components, edited.identity_components) == [
        "config_sha256 (key run.target)"]


def test_config_keys_that_change_no_hidden_state_keep_the_feature_set(tiny_target, config_target):
    same = config_target(transformers_version="9.9.9", eos_token_id=[2, 3], use_cache=False,
                         _name_or_path="/elsewhere")
    assert _meta(same).feature_set_id == _meta(tiny_target).feature_set_id


def test_a_rerun_with_an_edited_config_is_refused_and_leaves_the_table(tmp_path, tiny_target, config_target,
                                                                       monkeypatch):
    """Same weights, same tokenizer and template (the on-policy checks pass), rms_norm_eps edited:
    the re-run is refused naming the component and the key, and adds no row."""
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    rows = fs_helpers.prompt_rows(3, seed=2)
    uri = fs_helpers.prompts_store(tmp_path, rows[:2], tiny_target)
    assert build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)["captured"] == 2
    before = store.latest_version(uri, store.FEATURES)
    edited = config_target(rms_norm_eps=0.25)
    with pytest.raises(StoreError, match=r"differs in config_sha256 \(key run\.target\)\. Set featurestore\.table"):
        build.capture(target=str(edited), store_uri=uri, cfg=CFG)
    assert store.latest_version(uri, store.FEATURES) == before
    # The same target again resumes as before (nothing missing: no pass).
    assert build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)["target_forward_passes"] == 0


def test_a_table_captured_before_the_config_joined_the_identity_is_resumed(tmp_path, tiny_target, monkeypatch):
    """Stores captured by an eaglenest whose identity had no config_sha256 keep working: the re-run
    adds the missing rows to that table, under its own (older) feature-set id."""
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    rows = fs_helpers.prompt_rows(3, seed=4)
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    now = build.feature_meta(str(tiny_target), [], "auto", sample_ids=[r["sample_id"] for r in rows],
                             gen_params_ids=["g0"])
    comps = {k: v for k, v in now.identity_components.items() if k != "config_sha256"}
    old = S.FeatureMeta(**{**vars(now), "feature_set_id": identity.identity_hash(comps),
                           "identity": json.dumps(comps, sort_keys=True)})
    assert old.feature_set_id != now.feature_set_id
    writer = FeatureWriter(uri, store.FEATURES, old, budget=1 << 20)
    T = len(rows[0]["prompt_token_ids"]) + len(rows[0]["response_token_ids"])
    writer.add(build.feature_row(rows[0], np.zeros((T, 3, 128), np.float32), np.zeros((T, 128), np.float32), old))
    writer.commit()
    stats = build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert stats["captured"] == 2 and stats["feature_set_id"] == old.feature_set_id
    assert sorted(store.sample_ids(uri, store.FEATURES)) == [r["sample_id"] for r in rows]
