"""``evaluate/ngram.py`` against an independent plain implementation of the n-gram drafter (QA9).

The reference keeps the whole token sequence (no order-long context window), counts next tokens for
every context length directly, and decodes round by round as vLLM verifies: draft up to k tokens by
chaining guesses on the sequence so far, accept the longest matching prefix, emit it plus the target's
own next token. Random small cases (vocab of 5, orders 1-4, k 1 and 8) and long prompts (the context
buckets' replay), compared field by field.
"""

from __future__ import annotations

import collections
import random

import pyarrow as pa
import pytest

from eaglenest.evaluate import ngram


def reference(rows: list[tuple[list[int], list[int]]], order: int, prompt: list[int], output: list[int],
              k: int) -> tuple[int, int, list[int]]:
    """(rounds, accepted, accepted by position) of a plain n-gram drafter replaying ``output``."""
    counts: dict[tuple, collections.Counter] = {}
    for ids, mask in rows:
        for i in range(1, len(ids)):
            if not mask[i]:
                continue
            for n in range(1, order + 1):
                if i - n >= 0:
                    counts.setdefault(tuple(ids[i - n:i]), collections.Counter())[ids[i]] += 1

    def predict(seq: list[int]) -> int | None:
        for n in range(order, 0, -1):
            if len(seq) >= n and tuple(seq[len(seq) - n:]) in counts:
                c = counts[tuple(seq[len(seq) - n:])]
                top = max(c.values())
                return min(t for t, v in c.items() if v == top)
        return None

    seq, done = list(prompt) + list(output[:1]), 1
    rounds = accepted = 0
    by_pos = [0] * k
    while done < len(output):
        drafts: list[int] = []
        while len(drafts) < k and (g := predict(seq + drafts)) is not None:
            drafts.append(g)
        a = 0
        while a < len(drafts) and done + a < len(output) and drafts[a] == output[done + a]:
            by_pos[a] += 1
            a += 1
        rounds, accepted = rounds + 1, accepted + a
        seq += output[done:done + a + 1]
        done += a + 1
    return rounds, accepted, by_pos


def _batch(rows):
    return pa.RecordBatch.from_pylist([{"input_ids": ids, "loss_mask": mask} for ids, mask in rows])


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_replay_equals_a_plain_drafter(order, k):
    rng = random.Random(f"{order}:{k}")
    accepted = 0
    for case in range(40):
        vocab = rng.choice([2, 3, 5])
        rows = []
        for _ in range(rng.randint(0, 4)):
            n = rng.randint(1, 30)
            rows.append(([rng.randrange(vocab) for _ in range(n)], [rng.randint(0, 1) for _ in range(n)]))
        table = ngram.fit([_batch(rows)] if rows else [], order=order)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 25))]
        got = ngram.simulate(table, prompt, output, k)
        want = reference(rows, order, prompt, output, k)
        assert (got.rounds, got.accepted, got.by_position) == want, (case, rows, prompt, output)
        # Every round emits its accepted tokens and one of the target's, but the last round has no token of the
        # target's left when its guesses reach the output's end: rounds + accepted is the output after its
        # first token, or one more.
        assert max(len(output) - 1, 0) <= got.rounds + got.accepted <= max(len(output), 0), (case, output)
        if got.rounds:  # AL pooled over rounds
            assert got.acceptance_length == round(1 + want[1] / want[0], 4)
        else:  # an output of at most one token has no round to verify
            assert len(output) <= 1 and got.accepted == 0 and got.by_position == [0] * k
            assert got.acceptance_length is None  # no round measured: no AL, not a floor of 1.0
        accepted += got.accepted
    assert accepted > 0  # the cases are not all empty replays: guesses are compared, not only their absence


def test_long_prompt_replay_equals_a_plain_drafter():
    """A bucket's replay: a prompt of thousands of tokens whose last ``order`` tokens seed the first round."""
    rng = random.Random(7)
    text = [rng.randrange(50) for _ in range(400)]
    rows = [(text, [0] * 10 + [1] * 390)]
    table = ngram.fit([_batch(rows)], order=3)
    for length in (1024, 4096):
        prompt = [text[i % len(text)] for i in range(length)]
        output = text[length % len(text):][:64] + [rng.randrange(50) for _ in range(16)]
        for k in (1, 8):
            got = ngram.simulate(table, prompt, output, k)
            assert (got.rounds, got.accepted, got.by_position) == reference(rows, 3, prompt, output, k)
            assert got.accepted > 0  # the repeated text is guessed: the comparison is not of empty replays


def test_replays_pool_per_round_not_per_prompt():
    """A group's ``ngram_al`` pools rounds over its prompts (as vLLM's counters pool AL): a long output of
    many rounds weighs more than a short one, unlike a mean of per-prompt ALs."""
    table = ngram.fit([_batch([([1, 2, 3, 1, 2, 3, 1, 2, 3], [1] * 9)])], order=2)
    long_out = [1, 2, 3] * 10
    short_out = [1, 9, 9, 9]
    a, b = ngram.simulate(table, [], long_out, 3), ngram.simulate(table, [], short_out, 3)
    pooled = a + b
    assert pooled.rounds == a.rounds + b.rounds and pooled.accepted == a.accepted + b.accepted
    assert pooled.acceptance_length == round(1 + (a.accepted + b.accepted) / (a.rounds + b.rounds), 4)
    assert pooled.acceptance_length != round((a.acceptance_length + b.acceptance_length) / 2, 4)
