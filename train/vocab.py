"""The draft vocabulary: the most frequent target tokens among the tokens the draft must predict.

``draft_ids`` (target ids, ascending) has ``draft_vocab_size`` entries: the ids with the highest
count over loss-masked tokens, ties broken by the smaller id; if fewer distinct ids occur, the
smallest unseen ids fill the rest (they cost a row of lm_head and are never predicted in training).
Two maps derive from it, in the format vLLM and SpecForge checkpoints use:

* ``d2t`` int64 [draft_vocab_size]: offsets, ``target_id = draft_id + d2t[draft_id]``;
* ``t2d`` bool [target_vocab_size]: True where a target id is in the draft vocab.

Counts come from Arrow compute over the list columns (flatten, filter, bincount), one record batch
at a time, so a large table never materialises as Python objects.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from eaglenest.errors import ConfigError
from eaglenest.featurestore.read.query import loss_token_counts


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    draft_ids: np.ndarray  # int64 [Vd], ascending target ids
    target_vocab_size: int

    @property
    def size(self) -> int:
        return int(self.draft_ids.shape[0])

    @property
    def d2t(self) -> torch.Tensor:
        return torch.from_numpy(self.draft_ids - np.arange(self.size, dtype=np.int64))

    @property
    def t2d(self) -> torch.Tensor:
        t = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        t[torch.from_numpy(self.draft_ids)] = True
        return t

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, target_vocab_size: int) -> "DraftVocab":
        ids = (torch.arange(d2t.shape[0]) + d2t.long()).numpy().astype(np.int64)
        return cls(draft_ids=ids, target_vocab_size=target_vocab_size)


def count_loss_tokens(batches: Iterable[pa.RecordBatch], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: occurrences of each id where loss_mask == 1."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for rb in batches:
        ids = pc.list_flatten(rb.column("input_ids"))
        mask = pc.list_flatten(rb.column("loss_mask"))
        if len(ids) != len(mask):
            raise ConfigError("features: input_ids and loss_mask have different lengths")
        kept = pc.filter(ids, pc.equal(mask, pa.scalar(1, pa.uint8()))).to_numpy(zero_copy_only=False)
        if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
            bad = int(kept.min()) if kept.min() < 0 else int(kept.max())
            raise ConfigError(f"features: token id {bad} is outside the target vocab [0, {vocab_size}): the "
                              "features were captured with another target or tokenizer")
        counts += np.bincount(kept, minlength=vocab_size).astype(np.int64)
    return counts


def count_loss_tokens_in_store(store_uri: str, *, version: int | str | None, split: str, vocab_size: int,
                               table: str = "features") -> np.ndarray:
    """Like :func:`count_loss_tokens`, computed by one SQL aggregate over the store at ``version``
    (``featurestore.read.query``: unnest ids and mask, filter mask = 1, group by id), not in Python."""
    return loss_token_counts(store_uri, table, version=version, split=split, vocab_size=vocab_size)


def select_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top ``draft_vocab_size`` ids by count (desc), ties by id (asc); returned ascending."""
    vocab_size = counts.shape[0]
    if not 2 <= draft_vocab_size <= vocab_size:  # TrainConfig's lower bound: one token learns nothing
        raise ConfigError(f"train.draft_vocab_size: {draft_vocab_size} must be in [2, {vocab_size}] "
                          "(the target's vocabulary size)")
    # lexsort sorts by the last key first: primary -count, secondary id.
    order = np.lexsort((np.arange(vocab_size), -counts))
    ids = np.sort(order[:draft_vocab_size]).astype(np.int64)
    return DraftVocab(draft_ids=ids, target_vocab_size=vocab_size)


def build_vocab(batches: Iterable[pa.RecordBatch], *, vocab_size: int, draft_vocab_size: int) -> DraftVocab:
    return select_vocab(count_loss_tokens(batches, vocab_size), draft_vocab_size)


def coverage(counts: np.ndarray, vocab: DraftVocab) -> float:
    """Fraction of loss tokens whose id is in the draft vocab (an upper bound on accuracy)."""
    total = counts.sum()
    return float(counts[vocab.draft_ids].sum() / total) if total else 0.0
