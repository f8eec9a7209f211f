"""Mutation audit of the newest ingest tests (QA pass 12, honest tests): what an earlier harmony-format answer
goes back as, in the cases the qa12 tests left out (checked against the answer text written by hand)."""

from __future__ import annotations


import pytest

from eaglenest.hf import load_tokenizer
from eaglenest.ingest.reasoning import HARMONY_ANALYSIS, ThinkCheck
from ingest_helpers import harmony_target  # tests/ingest/conftest.py puts it on sys.path


@pytest.fixture
def harmony(tmp_path, tiny_target):
    root = harmony_target(tmp_path, tiny_target)
    tok = load_tokenizer(root, trust_remote_code=False)

    def history(raw: str) -> str:
        ids = tok(raw, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == raw  # the tags are the special tokens
        return ThinkCheck(HARMONY_ANALYSIS, "<|end|>", target=str(root)).history_text(
            ids, tok.decode(ids, skip_special_tokens=True))
    return history


def test_the_last_final_channel_is_the_answer(harmony):
    # an answer with two final messages (a draft, then the answer): the history holds the last one. A search
    # from the front (`find` for `rfind`) passed every qa12 test, whose answers hold one final channel.
    raw = ("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>final<|message|>First try.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>")
    assert harmony(raw) == "The answer is 4."


def test_an_answer_with_channels_but_no_final_goes_back_empty(harmony):
    # only analysis (cut off while thinking): no final channel, so nothing of it goes back ('' as documented),
    # not the channels run together as vLLM's text has them ("analysisStill thinking")
    assert harmony("<|channel|>analysis<|message|>Still thinking about it") == ""
