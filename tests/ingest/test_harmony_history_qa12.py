"""Multi-turn history of a harmony-format target (gpt-oss): earlier answers go back as their ``final`` channel."""

from __future__ import annotations

import json

import pytest

from eaglenest.hf import load_tokenizer
from eaglenest.ingest.backends import Completion
from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.pool import PoolEntry
from eaglenest.ingest.reasoning import ThinkCheck, resolve_tags
from eaglenest.ingest.regen import regenerate
from ingest_helpers import harmony_target  # tests/ingest/conftest.py puts it on sys.path

class Harmony:
    """Answers each chat turn in the harmony format, the text decoded as vLLM returns it (special tokens
    skipped); keeps each request's conversation."""

    max_in_flight = 4

    def __init__(self, tok):
        self.tok, self.ready, self.sent = tok, [], []

    def submit(self, key, kind, payload, gen):
        self.sent.append(json.loads(json.dumps(payload)))
        n = len(self.sent)
        answer = (f"<|channel|>analysis<|message|>Step {n}: think it over.<|end|>"
                  f"<|start|>assistant<|channel|>final<|message|>Answer {n}.<|return|>")
        prompt = self.tok.apply_chat_template(payload, add_generation_prompt=True, tokenize=False)
        ids = self.tok(answer, add_special_tokens=False)["input_ids"]
        self.ready.append((key, Completion(self.tok(prompt, add_special_tokens=False)["input_ids"], ids,
                                           self.tok.decode(ids, skip_special_tokens=True), "stop")))

    def poll(self):
        out, self.ready = self.ready, []
        return out


@pytest.mark.parametrize("special", [True, False], ids=["special tokens", "plain-text tags"])
def test_earlier_answers_of_a_harmony_target_go_back_as_their_final_channel(tmp_path, tiny_target, special):
    # gpt-oss answers "<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...".
    # The next turn's history held the answer's text as vLLM decodes it, special tokens skipped: the channels
    # joined ("analysisStep 1: ...assistantfinalAnswer 1."), which the template then rendered as the final
    # channel: the target was asked to continue a conversation it never had, and the stored row trained on it.
    # With the tags as plain text the history held them, and gpt-oss's template refuses such a content.
    root = harmony_target(tmp_path, tiny_target, special=special)
    tok = load_tokenizer(root, trust_remote_code=False)
    tags = resolve_tags([], tok)
    assert tags == ("<|channel|>analysis<|message|>", "<|end|>")
    think = ThinkCheck(*tags, target=str(root))
    entry = PoolEntry(sample_id="d-1", domain="d", source="s", split="train", mode="chat", system="",
                      prompt="What is 2 + 2?", later_turns=("And 3 + 3?", "And 4 + 4?"))
    backend = Harmony(tok)
    rows, failures = regenerate(backend, [entry], Generation(), "g", think=think)
    assert failures == [] and len(rows) == 1
    assert [m["content"] for m in backend.sent[2] if m["role"] == "assistant"] == ["Answer 1.", "Answer 2."]
    messages = json.loads(rows[0]["messages_json"])
    assert [m["content"] for m in messages[:-1] if m["role"] == "assistant"] == ["Answer 1.", "Answer 2."]
    # what the target saw is what the template makes of the stored history: capture can find the turns again
    rendered = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    assert tok(rendered, add_special_tokens=False)["input_ids"] == rows[0]["prompt_token_ids"]
    assert "Answer 2.<|end|><|start|>user<|message|>And 4 + 4?" in rendered
    assert messages[-1]["content"] == tok.decode(rows[0]["response_token_ids"], skip_special_tokens=True)


def test_an_answer_without_channels_goes_back_as_it_is(tmp_path, tiny_target):
    # a target that does not write the harmony format (here the tiny target answering plain text) is untouched
    think = ThinkCheck("<|channel|>analysis<|message|>", "<|end|>", target=str(tiny_target))
    assert think.history_text([5, 6, 7], "Plain answer.") == "Plain answer."
