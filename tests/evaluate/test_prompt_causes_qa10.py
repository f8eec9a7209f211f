"""Why `evaluate al` has no prompt to decode, named (hostile pass 10).

A published question whose first turn holds only invisible characters (a zero-width space, a byte-order
mark: what a copy from a web page leaves) was not skipped as empty; its content key is the empty text's,
which every raw training prompt of the store has (a raw row has no user turn), so a prompt set of such
questions ended in "every prompt was excluded as overlapping the training pool". A set whose every question
has an empty first turn said "no questions in <path>". Both now name the real cause."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.prompts import load_prompt_set
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store


def _store(tmp_path) -> str:
    """A prompts table with a chat and a raw training row (the raw one as ingest stores it: a document)."""
    def row(sid, mode, messages):
        return dict(sample_id=sid, domain="d", source="test", split="train", mode=mode,
                    messages_json=json.dumps(messages), prompt_token_ids=[], response_token_ids=[],
                    finish_reason="", gen_params_id="g")

    uri = str(tmp_path / "store")
    rows = [row("c0", "chat", [{"role": "user", "content": "What is 5 + 5?"}, {"role": "assistant", "content": "10"}]),
            row("r0", "raw", [{"role": "document", "content": "Once upon a time\n"},
                              {"role": "assistant", "content": " there was"}])]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


def _questions(tmp_path, *turns: str):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [t, "Then?"]}) + "\n"
                            for i, t in enumerate(turns, 1)))
    return EvaluateConfig(prompt_set="mt_bench", prompt_path=str(path))


@pytest.mark.parametrize("turns", [("", " \n"), ("\u200b", "\ufeff \u200b", "\u00ad")],
                         ids=["blank", "invisible"])
def test_every_question_with_an_empty_first_turn_is_named_as_the_cause(tmp_path, turns):
    with pytest.raises(ConfigError) as e:
        load_prompt_set(_questions(tmp_path, *turns), _store(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "overlap" not in msg
    assert f"all {len(turns)} questions of {tmp_path / 'question.jsonl'} have an empty first turn" in msg
    ids = ", ".join(str(i) for i in range(1, len(turns) + 1))  # every question, each once
    assert msg.endswith(f"(question_id {ids}): nothing to decode"), msg


def test_an_invisible_first_turn_is_skipped_and_counted_like_an_empty_one(tmp_path):
    groups, info = load_prompt_set(_questions(tmp_path, "Write a haiku.", "\u200b\u200b"), _store(tmp_path))
    assert [p["sample_id"] for ps in groups.values() for p in ps] == ["mt_bench-1"]
    assert (info["empty_first_turn"], info["empty_first_turn_ids"], info["overlap_excluded"]) == (1, ["2"], 0)


def test_a_set_emptied_by_both_causes_names_both(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_prompt_set(_questions(tmp_path, "  what IS 5 + 5? ", ""), _store(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg
    assert "of 2 questions" in msg and "1 skipped for an empty first turn (question_id 2)" in msg
    assert "1 excluded as overlapping the training pool" in msg
    assert "evaluate.exclude_overlap" in msg


def test_a_set_emptied_by_the_overlap_alone_still_says_so(tmp_path):
    with pytest.raises(ConfigError, match="every prompt was excluded as overlapping the training pool"):
        load_prompt_set(_questions(tmp_path, "What is 5 + 5?"), _store(tmp_path))
