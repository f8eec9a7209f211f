"""Evaluation prompts and long_chat composition: none is trained on inside a composed conversation."""

import json

from eaglenest.config import build
from eaglenest.ingest import compose, contamination
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import build_pool, load_pool

EVAL = "Compose an engaging travel blog post about a recent trip to Hawaii."


def _words(text: str) -> int:
    return len(text.split())


def _setup(tmp_path, per_length: int, *, with_eval: bool = True):
    rows = [{"prompt": f"Tell me fact number {i} about rivers and lakes please."} for i in range(6)]
    rows += [{"prompt": EVAL}] if with_eval else []
    (tmp_path / "src.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "question.jsonl").write_text(json.dumps({"question_id": 81, "turns": [EVAL, "Rewrite it."]}) + "\n")
    m = build(Manifest, {"name": "t", "licence": "x", "held_out_count": 0,
                         "contamination": {"mt_bench": [str(tmp_path / "question.jsonl")] if with_eval else []},
                         "domains": {"long": {"cap_prompts": 500, "compose": {
                             "rule": "long_chat", "target_tokens": [256, 384], "per_length": per_length,
                             "answer_tokens": 20}, "sources": [{"path": str(tmp_path / "src.jsonl"),
                                                                "provenance": "p"}]}}})
    loaded = [{"prompt": r["prompt"], "system": "", "later_turns": [], "source": "s"} for r in rows]
    return m, loaded


def test_an_evaluation_prompt_in_the_first_turn_of_a_composed_chat_is_contaminated(tmp_path):
    # The first turn of a long chat is the fact preamble, then a prompt: the exact check compared the
    # whole turn with the evaluation prompts, so an MT-Bench question there was trained on (3 of 60 chats).
    m, loaded = _setup(tmp_path, per_length=30)
    pool = build_pool(m, compose.apply(m, {"long": loaded}, count_tokens=_words), count_tokens=_words)
    first = [e for e in pool if e.prompt.endswith("\n\n" + EVAL)]
    assert first  # the data has the case this test is about
    kept, report = contamination.check(pool, m)
    assert not [e.sample_id for e in kept if any(EVAL in t for t in e.user_turns())]
    assert {e.sample_id for e in first} <= set(report["sample_ids"])


def test_evaluation_prompts_are_left_out_before_composing_not_whole_chats_after(tmp_path, tiny_target):
    # One MT-Bench question among the source rows sat in most long chats, and each chat holding it was
    # dropped whole as contaminated (19 of 60): the question is left out of the rows, as a held-out one is.
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    m, _ = _setup(tmp_path / "with", per_length=30)
    pool = load_pool(m, target=str(tiny_target))
    kept, report = contamination.check(pool, m)
    assert report["contaminated"] == 0 and len(kept) == len(pool)
    # the same chats as from the rows without the question (the reference: nothing to leave out there)
    clean, _ = _setup(tmp_path / "without", per_length=30, with_eval=False)
    assert pool == load_pool(clean, target=str(tiny_target))
