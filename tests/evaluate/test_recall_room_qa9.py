"""A ``recall`` context bucket with held-out answers longer than the bucket has room for (QA9).

``evaluate al`` checks the buckets' generated material before its engine starts (``plan`` ->
``buckets.check_generated``), ``recall`` with generated middle turns since the held-out answers are not decoded
yet. The real build puts held-out chats with the target's answers between the first turn and the question;
an answer longer than the room left (a short bucket: a target of few positions, ``evaluate.context_buckets``
of a few hundred tokens) made the build refuse the bucket after the check had passed, once the engine had
decoded every group. The prompt now takes generated turns there (the same question and evidence), so what
the check passed is built. Tokenizer only, no engine.
"""

from __future__ import annotations

import logging

import pytest
from transformers import AutoTokenizer

from eaglenest.evaluate.buckets import bucket_lengths, build_bucket_prompts, check_generated
from eaglenest.evaluate.longctx import generate

#: One held-out chat whose answer (the target's own, up to evaluate.max_tokens) is long.
LONG = [([{"role": "user", "content": "Describe the sea at night."}], "The sea is dark and wide. " * 40)]


@pytest.fixture(scope="module")
def tok(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.mark.parametrize("bucket", [200, 300])
def test_a_bucket_the_check_passed_is_built(caplog, tok, bucket):
    lengths = bucket_lengths((bucket,), max_positions=4096, max_tokens=64)
    check_generated(tok, lengths, kinds=("recall",), per_bucket=2)  # what plan runs before the engine: passes
    with caplog.at_level(logging.WARNING):
        out = build_bucket_prompts(tok, LONG, (bucket,), per_bucket=2, max_positions=4096, max_tokens=64,
                                   kinds=("recall",))
    rows = out[bucket]
    assert [len(r["prompt_token_ids"]) for r in rows] == [bucket, bucket]
    assert all(r["material_passes"] == 0 for r in rows)  # generated turns, and the row says so
    assert all(0 < r["evidence_distance_tokens"] < bucket for r in rows)
    said = [r.getMessage() for r in caplog.records if "held-out turn" in r.getMessage()]
    assert len(said) == 2 and said[0].endswith("generated turns instead"), said


def test_the_question_stays_paired_and_long_buckets_keep_the_held_out_turns(tok):
    """Prompt i asks the same question at every length: at 300 tokens (generated turns) as at 2048 (the
    held-out chat, one pass over it)."""
    short = generate("recall", tok, 300, seed=5, material=LONG)
    long = generate("recall", tok, 2048, seed=5, material=LONG)
    assert short.answer == long.answer and short.answer_value == long.answer_value
    assert short.material_passes == 0 and long.material_passes >= 1
    assert "The sea is dark and wide." in tok.decode(long.prompt_token_ids)
    assert "The sea is dark and wide." not in tok.decode(short.prompt_token_ids)
