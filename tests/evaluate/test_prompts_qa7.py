"""Held-out multi-turn conversations: ingest stores them unanswered (every user turn, no assistant
turn between), and evaluation decodes their first turn only (docs/evaluate.md), never the later user
turns run together as one prompt of consecutive user messages."""

from __future__ import annotations

import pyarrow as pa

from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.prompts import heldout, load_prompt_set
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store
from eaglenest.ingest.pool import PoolEntry
from eaglenest.ingest.regen import heldout_row, row


def _entry(sid: str, split: str, prompt: str, *later: str, system: str = "") -> PoolEntry:
    return PoolEntry(sample_id=sid, domain="chat room", source="s", split=split, mode="chat", system=system,
                     prompt=prompt, later_turns=tuple(later))


def test_a_heldout_conversation_is_decoded_from_its_first_turn_only(tmp_path):
    uri = str(tmp_path / "store")
    multi = _entry("h-multi", "heldout", "Name a colour.", "Why that one?", "And another?", system="Be brief.")
    single = _entry("h-single", "heldout", "Count to three.")
    trained = _entry("t-0", "train", "Count to three, slowly.")
    rows = [heldout_row(multi, "g"), heldout_row(single, "g"),
            row(trained, messages=trained.messages() + [{"role": "assistant", "content": "1, 2, 3."}],
                prompt_ids=[1], response_ids=[2], finish_reason="stop", gen_id="g")]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))

    groups = heldout(uri, "heldout")
    by_id = {p["sample_id"]: p["messages"] for p in groups["chat room"]}
    assert by_id["h-multi"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Name a colour."}]
    assert by_id["h-single"] == [{"role": "user", "content": "Count to three."}]
    for msgs in by_id.values():  # a prompt the target's template can render: roles alternate
        roles = [m["role"] for m in msgs if m["role"] != "system"]
        assert roles == ["user"]

    got, info = load_prompt_set(EvaluateConfig(), uri)
    assert sorted(p["sample_id"] for p in got["chat room"]) == ["h-multi", "h-single"]
    assert info["evaluated"] == 2 and info["overlap_excluded"] == 0


def test_a_heldout_conversation_whose_first_turn_was_trained_on_is_excluded(tmp_path):
    # The decoded prompt is the first turn: a training prompt with that text is an overlap, whatever
    # later turns the held-out conversation had.
    uri = str(tmp_path / "store")
    multi = _entry("h-multi", "heldout", "Name a colour.", "Why that one?")
    other = _entry("h-other", "heldout", "Count to three.")
    trained = _entry("t-0", "train", "Name a colour.")
    rows = [heldout_row(multi, "g"), heldout_row(other, "g"),
            row(trained, messages=trained.messages() + [{"role": "assistant", "content": "Blue."}],
                prompt_ids=[1], response_ids=[2], finish_reason="stop", gen_id="g")]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    got, info = load_prompt_set(EvaluateConfig(), uri)
    assert [p["sample_id"] for p in got["chat room"]] == ["h-other"]
    assert info["overlap_ids"] == ["h-multi"]
