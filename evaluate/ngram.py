"""How predictable a group's text is for *a drafter*: the AL an n-gram table would reach.

``target_confidence`` measures how sure the target is of its own next token. That is not what a
draft needs: a draft must guess several tokens ahead from shallow context, so a group where the
target computes its answer (arithmetic) can be certain for the target and still hard to draft,
and formulaic text where the target hesitates between near-equivalents can be easy. This module
measures predictability from the draft's side, with no model at all:

* :func:`fit` builds an n-gram table from the **training pool** (the loss-masked tokens of the
  store's features table, the same tokens the draft was trained on): for every context of up to
  ``order`` preceding tokens, the token that most often followed it.
* :func:`simulate` replays greedy speculative decoding over the target's actual output for a
  prompt: each round the table chains up to ``k`` guesses (longest known context first, backing
  off to shorter ones), the guesses are accepted while they equal the target's tokens, and the
  round emits the accepted tokens plus the target's own token, as vLLM's verification does.

``ngram_al = 1 + accepted / rounds`` pooled over a group is then the AL of a training-free n-gram
drafter on the same outputs: a floor a learned draft should beat, and a predictability measure on
the same scale as AL. Pure functions over Arrow batches and token lists; reading the store is
:func:`fit_from_store`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Iterable

import pyarrow as pa

from eaglenest.featurestore.table import store

#: What ``ngram_al`` is, written into every report that has it.
MEASURE = ("AL a training-free n-gram drafter reaches on the same target outputs: a table of the "
           "most frequent next token after each context of up to {order} tokens, fitted on the "
           "{fit_tokens} loss tokens of the training split of `{table}` v{version}, chaining {k} "
           "guesses per round (greedy, pooled over rounds)")


@dataclasses.dataclass(frozen=True)
class NgramTable:
    """context (tuple of up to ``order`` token ids) -> most frequent next token."""

    order: int
    next_token: dict
    fit_tokens: int

    def guess(self, context: list[int]) -> int | None:
        """The next token after ``context``: longest known suffix first (order, order-1, .. 1)."""
        for n in range(min(self.order, len(context)), 0, -1):
            tok = self.next_token.get(tuple(context[-n:]))
            if tok is not None:
                return tok
        return None


def _loss_positions(batches: Iterable[pa.RecordBatch]):
    """(token ids, i) for every loss-masked position i >= 1 of every row, in order."""
    for batch in batches:
        for ids, mask in zip(batch.column("input_ids").to_pylist(), batch.column("loss_mask").to_pylist()):
            for i in range(1, len(ids)):
                if mask[i]:
                    yield ids, i


def fit(batches: Iterable[pa.RecordBatch], *, order: int = 3, max_tokens: int = 0) -> NgramTable:
    """An n-gram table over the loss-masked positions of ``batches`` (columns ``input_ids`` and
    ``loss_mask``). Ties between next tokens go to the smallest token id, so a fit is
    deterministic. ``max_tokens`` > 0 stops after that many loss tokens."""
    if order < 1:
        raise ValueError(f"n-gram order must be >= 1, got {order}")
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    seen = 0
    for ids, i in itertools.islice(_loss_positions(batches), max_tokens or None):
        for n in range(1, min(order, i) + 1):
            counts[tuple(ids[i - n:i])][ids[i]] += 1
        seen += 1
    table = {ctx: min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] for ctx, c in counts.items()}
    return NgramTable(order=order, next_token=table, fit_tokens=seen)


@dataclasses.dataclass
class Replay:
    """Counters of one or more replays, combined with ``+``; same meaning as vLLM's."""

    rounds: int = 0
    accepted: int = 0
    by_position: list[int] = dataclasses.field(default_factory=list)

    def __add__(self, other: "Replay") -> "Replay":
        k = max(len(self.by_position), len(other.by_position))
        pos = [(self.by_position + [0] * k)[i] + (other.by_position + [0] * k)[i] for i in range(k)]
        return Replay(self.rounds + other.rounds, self.accepted + other.accepted, pos)

    @property
    def acceptance_length(self) -> float | None:
        return round(1 + self.accepted / self.rounds, 4) if self.rounds else None


def simulate(table: NgramTable, prompt_ids: list[int], output_ids: list[int], k: int) -> Replay:
    """Greedy speculative decoding of ``output_ids`` (the target's own tokens) with ``table`` as
    the drafter, ``k`` guesses per round. As in vLLM, the first output token comes from the
    prefill (no round); each later round checks up to ``k`` guesses against the tokens the target
    produced and emits the accepted ones plus the target's next token."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    context = (list(prompt_ids) + list(output_ids[:1]))[-table.order:]
    out = Replay(by_position=[0] * k)
    i = 1
    while i < len(output_ids):
        ctx, accepted = list(context), 0
        for j in range(min(k, len(output_ids) - i)):
            guess = table.guess(ctx)
            if guess is None or guess != output_ids[i + j]:
                break
            accepted += 1
            out.by_position[j] += 1
            ctx.append(guess)
        out.rounds += 1
        out.accepted += accepted
        emitted = output_ids[i:i + accepted + 1]
        context = (context + emitted)[-table.order:]
        i += accepted + 1
    return out


def fit_from_store(store_uri: str, table: str, *, order: int, max_tokens: int) -> tuple[NgramTable, int]:
    """Fit on the training split of a features table's latest version; returns (table, version).
    Reads the token columns only (hidden states are not touched)."""
    ds = store.dataset(store_uri, table)
    batches = ds.to_batches(columns=["input_ids", "loss_mask"], filter="split = 'train'", batch_size=256)
    return fit(batches, order=order, max_tokens=max_tokens), ds.version
