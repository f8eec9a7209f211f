"""Seventh QA pass on `featurestore capture` around the target's chat template: a target with no chat
template at all (a base model's hidden states for an instruct model's chats, run.off_policy=true)
capturing multi-turn conversations. The engine is a stub (named so): what is tested is what capture
does with the stored conversations before and around it."""

from __future__ import annotations

import json
import shutil

from eaglenest.engine import EngineConfig
from eaglenest.featurestore.capture import build
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


def test_a_target_without_a_chat_template_trains_multi_turn_rows_on_their_last_answer(tmp_path, tiny_target,
                                                                                        monkeypatch, caplog):
    """Capturing with a target that has no chat template (off-policy: a base model for chats another
    generated) rendered each multi-turn conversation's earlier turns with it for their loss spans:
    transformers' ValueError ("does not have a chat template"), a traceback mid-capture with the
    engine up. Now as a template that cannot reproduce the prompt: a warning, the last answer trained."""
    target = tmp_path / "base model"  # a blank in the path too
    shutil.copytree(tiny_target, target)
    cfg_path = target / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    del tok_cfg["chat_template"]
    cfg_path.write_text(json.dumps(tok_cfg))
    rows = fs_helpers.prompt_rows(2, seed=3)
    rows[1]["mode"] = "chat"
    rows[1]["messages_json"] = json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                           {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    with caplog.at_level("WARNING", logger=build.__name__):
        assert build.capture(target=str(target), store_uri=uri, cfg=CFG, off_policy=True)["captured"] == 2
    got = store.read(uri, store.FEATURES, columns=["sample_id", "num_loss_tokens"]).to_pylist()
    assert {r["sample_id"]: r["num_loss_tokens"] for r in got} == {
        r["sample_id"]: len(r["response_token_ids"]) for r in rows}
    assert "has no chat template" in caplog.text
