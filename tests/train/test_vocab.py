"""Draft vocabulary selection and the d2t / t2d maps on a hand-made table."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.train.vocab import DraftVocab, build_vocab, count_loss_tokens, select_vocab


def table(rows):
    return pa.table({"input_ids": pa.array([r[0] for r in rows], pa.list_(pa.int32())),
                     "loss_mask": pa.array([r[1] for r in rows], pa.list_(pa.uint8()))})


HAND = table([
    # id 9 appears 5x but only twice under the mask; id 3 three times masked; 7 and 5 twice (tie).
    ([9, 9, 9, 3, 3, 7], [0, 0, 1, 1, 1, 1]),
    ([3, 5, 5, 7, 9, 0], [1, 1, 1, 1, 1, 0]),
])


def test_counts_only_loss_tokens():
    c = count_loss_tokens(HAND.to_batches(max_chunksize=1), vocab_size=10)
    assert c.tolist() == [0, 0, 0, 3, 0, 2, 0, 2, 0, 2]


def test_top_k_ties_by_id_and_sorted():
    v = build_vocab(HAND.to_batches(), vocab_size=10, draft_vocab_size=3)
    # 3 (count 3) then a three-way tie at 2 between 5, 7, 9: the smaller ids 5 and 7 win.
    assert v.draft_ids.tolist() == [3, 5, 7]
    assert v.d2t.tolist() == [3, 4, 5] and v.d2t.dtype == torch.int64
    assert (torch.arange(3) + v.d2t).tolist() == [3, 5, 7]
    assert v.t2d.dtype == torch.bool and torch.nonzero(v.t2d).flatten().tolist() == [3, 5, 7]


def test_fill_with_unseen_smallest_ids():
    v = build_vocab(HAND.to_batches(), vocab_size=10, draft_vocab_size=6)
    assert v.draft_ids.tolist() == [0, 1, 3, 5, 7, 9]


def test_round_trip_from_d2t():
    v = select_vocab(torch.randint(0, 50, (300,)).numpy(), 40)
    back = DraftVocab.from_d2t(v.d2t, 300)
    assert back.draft_ids.tolist() == v.draft_ids.tolist()


def test_errors_name_the_key():
    with pytest.raises(ConfigError, match="train.draft_vocab_size"):
        build_vocab(HAND.to_batches(), vocab_size=10, draft_vocab_size=11)
    with pytest.raises(ConfigError, match=r"token id 9 is outside the target vocab \[0, 8\)"):
        count_loss_tokens(HAND.to_batches(), vocab_size=8)
