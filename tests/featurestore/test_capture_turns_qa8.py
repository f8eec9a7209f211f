"""Eighth QA pass on `featurestore capture`: the loss mask of a multi-turn conversation's earlier
answers when the template closes a turn with a token that is not the tokenizer's eos (Gemma's
``<end_of_turn>`` beside its ``<eos>``; generation stops at both, as generation_config.json says).
The earlier answers' spans ran on past the turn's end over the newline the template writes after it,
which the target never generated (turns.py: "template formatting after it ... is not the model's
output"). The engine is a stub (named so): what is tested is the mask capture stores."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from eaglenest.engine import EngineConfig
from eaglenest.featurestore.capture import build
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(engine=EngineConfig(max_model_len=256, memory_fraction=0.1))
CONV = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"},
        {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "5 x 4 = 20"},
        {"role": "user", "content": "In words?"}, {"role": "assistant", "content": "twenty"}]
#: Gemma's layout on the tiny vocabulary: each turn closed by <end_of_turn> and a newline.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def turn_end_target(tmp_path_factory, tiny_target):
    dst = tmp_path_factory.mktemp("gemma like") / "tärget"
    shutil.copytree(tiny_target, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    new_id = max(t["id"] for t in tok["added_tokens"]) + 1
    tok["added_tokens"].append({"id": 1141, "content": "<end_of_turn>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    assert new_id <= 1141
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = json.loads((dst / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], 1141]
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def test_earlier_answers_are_masked_up_to_their_end_of_turn_token(tmp_path, turn_end_target, monkeypatch):
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    tok = AutoTokenizer.from_pretrained(turn_end_target)
    assert tok.eos_token_id != tok.convert_tokens_to_ids("<end_of_turn>")
    prompt = list(tok.apply_chat_template(CONV[:-1], add_generation_prompt=True, tokenize=True)["input_ids"])
    response = tok.encode("twenty<end_of_turn>", add_special_tokens=False)
    row = {**fs_helpers.prompt_rows(1)[0], "mode": "chat", "messages_json": json.dumps(CONV),
           "prompt_token_ids": prompt, "response_token_ids": response, "finish_reason": "stop"}
    uri = fs_helpers.prompts_store(tmp_path, [row], turn_end_target)
    build.capture(target=str(turn_end_target), store_uri=uri, cfg=CFG)
    got = store.read(uri, store.FEATURES, columns=["input_ids", "loss_mask", "num_loss_tokens"]).to_pylist()[0]
    ids, mask = got["input_ids"], got["loss_mask"]
    assert ids == prompt + response
    # The masked runs, decoded: each earlier answer through its <end_of_turn>, no newline after it.
    runs, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    runs.append(run)
    assert [tok.decode(r) for r in runs] == ["2 + 3 = 5<end_of_turn>", "5 x 4 = 20<end_of_turn>",
                                             "twenty<end_of_turn>"]
    assert got["num_loss_tokens"] == sum(mask)


def test_the_stop_ids_are_generation_configs(turn_end_target, tiny_target, tmp_path):
    assert build.stop_ids(str(turn_end_target)) == [2, 1141]
    assert build.stop_ids(str(tiny_target)) == [2]
    assert build.stop_ids(str(tmp_path)) == []  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": true}')
    assert build.stop_ids(str(tmp_path)) == []
