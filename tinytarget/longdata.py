"""Training rows for the long-context tiny target: long material with answers, and skipped positions.

Each row is ``seq_len_tokens`` token ids. Rows go round-robin over four kinds:

- ``records``, ``code``, ``recall``: a prompt of ``evaluate.longctx`` (the evaluation's own
  generator, so the formats match) drawn with a *training* seed (``TRAIN_SEED_BASE + row``, a range
  the evaluation's per-prompt seeds never take), its reference answer and ``<|end|>``, then short
  corpus documents packed after it to fill the row. The answer tokens are marked: the loss weighs
  them extra, since they are the few tokens whose prediction needs the far evidence. With
  ``sample_tokens`` several shorter prompts are packed per row: more answers per unit of compute.
- ``chat``: short corpus documents packed to the row's length (the short corpus keeps its share,
  so short-prompt quality is kept).
- ``copy`` (opt in, ``--row-kinds``): a span of random ordinary tokens, corpus text, then the same
  span again, the repeat marked as answer: copying from far back within natural text.
- ``repeat`` (opt in): a span of random ordinary tokens (8-96 of them, at most a quarter of the row)
  repeated to fill the row, every token after the first period marked: the textbook task for
  forming a copy-from-context circuit (an induction head) in small transformers; ``repeatN``: the
  same over a fixed alphabet of N tokens. The retrieval kinds alone, ``copy`` rows among them, or
  ``repeat`` rows over the whole vocabulary formed none here; a curriculum of alphabets (``repeat64``,
  ``repeat256``, then ``repeat``, 32 rows of 128 tokens, constant lr) did (docs/long_context.md,
  runs M-T); ``longeval.copy_probe`` tells which.

Positions (``skipped_positions``): a row of real length ``n`` may be given position ids that skip a
random gap at a random cut, so its two parts lie up to ``max_positions`` apart (PoSE, "positional
skip-wise" training). Attention still costs what an ``n``-token row costs, while the relative
distances the model learns reach the full 32K. Trade-off: a skipped row has no tokens in the gap, so
it teaches the distances, not reading 32K real tokens; the real-length stage (8K rows) teaches that.
"""

from __future__ import annotations

import random
import re
from typing import Iterator

from eaglenest.evaluate import longctx
from eaglenest.tinytarget import corpus

#: Kinds of training rows, in round-robin order (the default).
ROW_KINDS = ("records", "code", "recall", "chat")
#: Every kind a build may name (and ``repeatN``: a ``repeat`` row over an alphabet of N tokens).
ALL_KINDS = (*ROW_KINDS, "copy", "repeat")
#: Tokens in the repeated span of a ``copy`` row.
COPY_SPAN = 64
#: Shortest and longest period of a ``repeat`` row (drawn per row: with one fixed period a model
#: learns "attend that many positions back" instead of matching content; run J2), and at most a
#: quarter of the row (a 128-token row with one repeat of 64 tokens formed nothing: run Q), drawn
#: uniformly between them (drawing up to 96 and capping gave 3 rows in 4 the same period: run V).
REPEAT_SPAN = (8, 96)
#: Seeds of training prompts are TRAIN_SEED_BASE + row index. The evaluation's per-prompt seeds
#: (``evaluate.buckets._prompt_seed``) are ``(seed * 1000003 + 2**20) * 1000003 + i`` (the same
#: at every bucket length): for engine seed 0 they are >= 2**20 * 1000003 > TRAIN_SEED_BASE + any row here.
TRAIN_SEED_BASE = 1_000_000
#: Packed prompts (several per row) take seeds from PACKED_SEED_BASE up, at most 64 per row: below
#: the evaluation's smallest (2**20 * 1000003) for the first 12 million rows, and above the unpacked.
PACKED_SEED_BASE = 200_000_000
#: At most this many packed prompts per row (their seeds are spaced that far apart).
MAX_PACKED = 64
#: Held-out chats used as the ``recall`` kind's middle turns in training rows.
NUM_MATERIAL = 256


def chat_material(samples: list[dict]) -> list[tuple[list[dict], str]]:
    """(prompt messages, answer) pairs from corpus samples, the form ``evaluate.longctx`` takes."""
    return [(corpus.to_messages(s, with_response=False), s["response"]) for s in samples]


class DocStream:
    """An endless stream of short corpus documents (chat form, or raw text for a fraction), as ids."""

    def __init__(self, hf_tok, *, seed: int, raw_fraction: float) -> None:
        self.tok, self.raw_fraction = hf_tok, raw_fraction
        self.rng = random.Random(f"longdocs:{seed}")
        self.seed, self.buf, self.made = seed, [], 0

    def _more(self) -> None:
        batch = corpus.generate(512, seed=self.seed * 100_003 + self.made)
        self.made += 1
        texts = []
        for s in batch:
            if self.rng.random() < self.raw_fraction:
                texts.append(self.tok.bos_token + corpus.to_raw_text(s) + self.tok.eos_token + "\n")
            else:
                texts.append(self.tok.apply_chat_template(corpus.to_messages(s), tokenize=False))
        for ids in self.tok(texts, add_special_tokens=False)["input_ids"]:
            self.buf.extend(ids)

    def take(self, n: int) -> list[int]:
        while len(self.buf) < n:
            self._more()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


#: Room left for the reference answer after a prompt (the longest, a record's name + <|end|>, is
#: well under this).
ANSWER_ROOM = 48


def packed_seed(row_seed: int, j: int) -> int:
    """The seed of packed prompt ``j`` (< ``MAX_PACKED``) of the row seeded ``row_seed``."""
    assert 0 <= j < MAX_PACKED
    return PACKED_SEED_BASE + (row_seed - TRAIN_SEED_BASE) * MAX_PACKED + j


def copy_row(hf_tok, length: int, *, seed: int, docs: DocStream) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of a ``copy`` row: ``COPY_SPAN`` random ordinary tokens at a random place,
    the same span again a random distance later (corpus text between and around), the repeat after
    its first token marked: predicting it needs the first span, however far back it is."""
    rng = random.Random(f"copy:{seed}")
    ordinary = ordinary_ids(hf_tok)
    span = [rng.choice(ordinary) for _ in range(COPY_SPAN)]
    gap = rng.randint(0, length - 2 * COPY_SPAN)
    lead = rng.randint(0, length - 2 * COPY_SPAN - gap)
    ids = docs.take(lead) + span + docs.take(gap) + span
    mask = [0] * (lead + COPY_SPAN + gap + 1) + [1] * (COPY_SPAN - 1)
    rest = length - len(ids)
    return ids + docs.take(rest), mask + [0] * rest


def repeat_alphabet(kind: str) -> int | None:
    """N of a ``repeatN`` kind (N >= 2), 0 for ``repeat``, None for any other kind."""
    if kind == "repeat":
        return 0
    m = re.fullmatch(r"repeat([0-9]+)", kind)
    return int(m[1]) if m and int(m[1]) >= 2 else None


def known_kind(kind: str) -> bool:
    return kind in ALL_KINDS or repeat_alphabet(kind) is not None


def ordinary_ids(hf_tok) -> list[int]:
    """Every token id that is not a special token."""
    special = set(hf_tok.all_special_ids)
    return [t for t in range(len(hf_tok)) if t not in special]


def repeat_row(hf_tok, length: int, *, seed: int, alphabet: int = 0) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of a ``repeat`` row: a period of random ordinary tokens (its length drawn
    from ``REPEAT_SPAN``) repeated to ``length``; every token after the first period is marked (each
    is the token one period back). ``alphabet`` > 0: the tokens come from that many ordinary ids
    only (the same ones in every row: the first of a fixed shuffle), a curriculum's easy start."""
    rng = random.Random(f"repeat:{seed}")
    ordinary = ordinary_ids(hf_tok)
    if alphabet:
        random.Random("repeat-alphabet").shuffle(ordinary)
        ordinary = ordinary[:alphabet]
    lo, hi = REPEAT_SPAN  # uniform over the periods the row allows (3 repeats at least): a cap on a
    period = rng.randint(lo, max(lo, min(hi, length // 4)))  # wider draw made most rows one period
    span = [rng.choice(ordinary) for _ in range(period)]
    ids = (span * (length // period + 1))[:length]
    return ids, [0] * period + [1] * (length - period)


def long_row(kind: str, hf_tok, length: int, *, seed: int, material, docs: DocStream,
             sample_tokens: int = 0) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of one ``length``-token row of ``kind``: one prompt of about ``length``
    tokens, or with ``sample_tokens`` (< ``length``) ``length // sample_tokens`` prompts of that
    size packed one after another (more answers per row; prompt ``j`` seeded by ``packed_seed``)."""
    if kind == "chat":
        return docs.take(length), [0] * length
    if kind == "copy":
        return copy_row(hf_tok, length, seed=seed, docs=docs)
    if repeat_alphabet(kind) is not None:
        return repeat_row(hf_tok, length, seed=seed, alphabet=repeat_alphabet(kind))
    size = sample_tokens if 0 < sample_tokens < length else length
    count = length // size
    ids, mask = [], []
    for j in range(count):
        p = longctx.generate(kind, hf_tok, size - ANSWER_ROOM, seed=seed if count == 1 else packed_seed(seed, j),
                             material=material)
        answer = hf_tok(p.answer + hf_tok.eos_token + "\n", add_special_tokens=False)["input_ids"]
        ids += p.prompt_token_ids + answer
        mask += [0] * len(p.prompt_token_ids) + [1] * len(answer)
    rest = length - len(ids)
    assert rest >= 0, (kind, length, len(ids))
    return ids + docs.take(rest), mask + [0] * rest


def rows(hf_tok, length: int, num_rows: int, *, first_row: int, material, docs: DocStream,
         sample_tokens: int = 0, kinds: tuple[str, ...] = ROW_KINDS) -> Iterator[tuple[list[int], list[int]]]:
    """``num_rows`` rows of ``length`` tokens, ``kinds`` round-robin, row ``first_row + k`` seeded by it."""
    for k in range(num_rows):
        r = first_row + k
        yield long_row(kinds[r % len(kinds)], hf_tok, length, seed=TRAIN_SEED_BASE + r,
                       material=material, docs=docs, sample_tokens=sample_tokens)


def skipped_positions(length: int, max_positions: int, rng: random.Random) -> list[int]:
    """Position ids ``0..c-1`` then ``c+s..length-1+s``: one gap ``s`` at a cut ``c`` (PoSE)."""
    cut = rng.randint(1, length - 1)
    skip = rng.randint(0, max_positions - length)
    return list(range(cut)) + list(range(cut + skip, length + skip))
