"""The n-gram predictability measure: fit over loss-masked tokens, replay of speculative rounds,
and the fit from a real Lance features table (training split only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.evaluate import ngram


def _batch(seqs):
    return pa.RecordBatch.from_pydict({"input_ids": [s[0] for s in seqs], "loss_mask": [s[1] for s in seqs]})


def test_fit_and_replay_worked_example():
    ids = [5, 1, 2, 3, 1, 2, 3, 1, 2, 4]
    table = ngram.fit([_batch([(ids, [0] + [1] * 9)])], order=2)
    # After (1, 2): 3 twice, 4 once; after (2,): 3 twice, 4 once.
    assert table.guess([9, 1, 2]) == 3 and table.guess([2]) == 3 and table.guess([3]) == 1
    assert table.fit_tokens == 9
    # Prefill emits 1; round 1: guesses 2, 3, 1 all equal the output (3 accepted), emits 2 3 1 2;
    # round 2: one token (4) left, the guess after (1, 2) is 3: none accepted, emits 4.
    r = ngram.simulate(table, [5], [1, 2, 3, 1, 2, 4], k=3)
    assert (r.rounds, r.accepted, r.by_position) == (2, 3, [1, 1, 1])
    assert r.acceptance_length == 2.5
    # Combining replays pools rounds, as vLLM's counters do.
    both = r + ngram.simulate(table, [5], [1, 7, 7], k=3)
    assert (both.rounds, both.accepted) == (4, 3) and both.acceptance_length == 1.75


def test_fit_uses_loss_tokens_only_and_breaks_ties_low():
    # 8 follows 7 only at positions outside the loss mask: the table never learns it.
    table = ngram.fit([_batch([([7, 8, 7, 8, 6], [0, 0, 0, 0, 1])])], order=1)
    assert table.guess([7]) is None and table.guess([8]) == 6
    tie = ngram.fit([_batch([([1, 9, 1, 4], [0, 1, 0, 1])])], order=1)
    assert tie.guess([1]) == 4  # 9 and 4 once each: the smaller id wins, whatever the order
    capped = ngram.fit([_batch([([1, 2, 3, 4, 5], [1] * 5)])], order=2, max_tokens=3)
    assert capped.fit_tokens == 3 and capped.guess([3]) == 4 and capped.guess([4]) is None
    with pytest.raises(ValueError, match="n-gram order must be >= 1, got 0"):
        ngram.fit([], order=0)


def test_fit_from_store_reads_training_split_only(tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "featurestore"))
    import fs_helpers as H

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    m = H.meta()
    rows = H.rows(["a", "b"], m, num_tokens=4)
    rows[0].update(input_ids=[10, 11, 12, 13], loss_mask=[0, 1, 1, 1])
    rows[1].update(input_ids=[20, 21, 22, 23, 24], loss_mask=[0, 1, 1, 1, 1], split="heldout")
    store.append(str(tmp_path), "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    table, version = ngram.fit_from_store(str(tmp_path), "features", order=2, max_tokens=0)
    assert version == store.latest_version(str(tmp_path), "features")
    assert table.fit_tokens == 3 and table.guess([11, 12]) == 13 and table.guess([21]) is None
