"""Hostile inputs to capture (eleventh QA pass), without an engine: recipe values named by their own
key, and a conversation whose first turn is the assistant's."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, turns
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest


@pytest.mark.parametrize("key, value", [("commit_every", 0), ("batch_size", 0), ("batch_size", -3),
                                        ("write_buffer_mb", -1), ("write_buffer_mb", 0)])
def test_a_bad_size_is_refused_naming_its_own_key(key, value):
    """``featurestore.commit_every=0`` was refused as "featurestore.write_buffer_mb: must be > 0; ...":
    the line named another key first. Each key is named alone, with the value given."""
    with pytest.raises(ConfigError, match=rf"^featurestore\.{key}: must be .*got {value}$") as err:
        FeaturestoreConfig(**{key: value})
    others = {"commit_every", "batch_size", "write_buffer_mb"} - {key}
    assert not any(o in str(err.value) for o in others), err.value


@pytest.mark.parametrize("key, value", [("commit_every", 1.5), ("batch_size", True), ("write_buffer_mb", "big"),
                                        ("write_buffer_mb", True)])
def test_a_config_built_in_code_with_a_value_of_another_type_is_refused_naming_the_key(key, value):
    """A recipe's walker checks types; a config built in code was not: ``commit_every=1.5`` committed at
    the samples where ``i % 1.5 == 0``, ``write_buffer_mb="big"`` was a TypeError traceback."""
    with pytest.raises(ConfigError, match=rf"^featurestore\.{key}: must be a (whole )?number"):
        FeaturestoreConfig(**{key: value})


def test_the_cli_names_the_key_given(tmp_path, capsys):
    rc = featurestore_main(["capture", f"run.workdir={tmp_path / 'w'}", "featurestore.commit_every=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["featurestore: error: featurestore.commit_every: must be >= 1 (samples), got 0"]


def test_an_assistant_turn_first_gives_no_spans_not_a_traceback(tiny_target):
    """A conversation opening with the assistant (a greeting) has no messages before its first answer:
    transformers refuses to render an empty conversation with a ValueError, which ended the capture with
    a traceback once its engine was up. It is a conversation the template does not locate answers in:
    None (the caller trains on the last answer, with a warning)."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    msgs = [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye"}]
    prompt = list(tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert turns.assistant_spans(tok, msgs, prompt, {}, end_ids=[2]) is None


def test_a_capture_of_an_assistant_first_conversation_trains_on_its_last_answer(tmp_path, tiny_target,
                                                                               monkeypatch, caplog):
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)  # (the engine is not what is tested)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    msgs = [{"role": "assistant", "content": "Welcome!"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye"}]
    prompt = list(tok.apply_chat_template(msgs[:-1], add_generation_prompt=True, tokenize=True)["input_ids"])
    response = tok.encode("Bye<|end|>", add_special_tokens=False)
    row = {**fs_helpers.prompt_rows(1, seed=2)[0], "mode": "chat", "messages_json": json.dumps(msgs),
           "prompt_token_ids": prompt, "response_token_ids": response, "finish_reason": "stop"}
    uri = fs_helpers.prompts_store(tmp_path, [row], tiny_target)
    cfg = FeaturestoreConfig(engine=EngineConfig(max_model_len=64, memory_fraction=0.1))
    with caplog.at_level("WARNING"):
        assert build.capture(target=str(tiny_target), store_uri=uri, cfg=cfg)["captured"] == 1
    assert "does not reproduce the prompt; training on the last answer only" in caplog.text
    got = store.read(uri, store.FEATURES, columns=["loss_mask", "num_loss_tokens"]).to_pylist()[0]
    assert got["loss_mask"] == [0] * len(prompt) + [1] * len(response) and got["num_loss_tokens"] == len(response)


class _DiesAfterTwo(fs_helpers.StubCapturer):
    die_after = 2


def test_a_rerun_with_other_settings_after_a_capture_stopped_before_its_first_commit_captures(
        tmp_path, tiny_target, monkeypatch, caplog):
    """A capture whose engine died (or that was killed) after its first data files, before its first
    commit, leaves the table it created empty (version 1, no row). A re-run with a setting corrected
    (other layers, a dtype that fits) was refused as "holds feature set ..." though there was nothing to
    keep, and the user had to pick a new table name. The empty table is replaced; one holding rows is not."""
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.prompt_rows(4), tiny_target)
    monkeypatch.setattr(build, "Capturer", _DiesAfterTwo)
    first = FeaturestoreConfig(write_buffer_mb=1e-5, engine=EngineConfig(max_model_len=64))  # a fragment a row
    with pytest.raises(StoreError, match="the capture engine died"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=first)
    ds = store.dataset(uri, store.FEATURES)
    assert ds.count_rows() == 0 and len(ds.versions()) == 1  # the table the first data files created
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    other = FeaturestoreConfig(layer_ids=[1, 2, 3], commit_every=3, engine=EngineConfig(max_model_len=64))
    with caplog.at_level("WARNING"):
        stats = build.capture(target=str(tiny_target), store_uri=uri, cfg=other)
    assert "holds no row" in caplog.text and "layer_ids" in caplog.text
    assert stats["captured"] == 4 and stats["layer_ids"] == [1, 2, 3]
    assert S.feature_meta(store.dataset(uri, store.FEATURES).schema).layer_ids == (1, 2, 3)
    assert sorted(store.sample_ids(uri, store.FEATURES)) == ["s-000", "s-001", "s-002", "s-003"]
    with pytest.raises(StoreError, match=r"differs in layer_ids \(key featurestore\.layer_ids\)"):  # rows: kept
        build.capture(target=str(tiny_target), store_uri=uri, cfg=first)
    assert store.dataset(uri, store.FEATURES).count_rows() == 4
