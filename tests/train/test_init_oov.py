"""Draft initialisation from the target (lm_head rows, final norm) and the out-of-vocabulary rule
(issue 12)."""

from __future__ import annotations

import json

import numpy as np
import torch

from eaglenest.train import vocab as V
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import build_draft, drop_oov_positions
from eaglenest.train.target import load_target_tensors
from eaglenest.train.ttt import Batch


def _vocab(size=64, target_vocab=2048):
    counts = np.zeros(target_vocab, dtype=np.int64)
    counts[np.arange(3, 3 + 5 * size, 5)] = np.arange(5 * size, 0, -5)[:size]
    return V.select_vocab(counts, size)


def test_lm_head_and_norm_start_from_the_target(tiny_target):
    t = load_target_tensors(tiny_target)
    vocab = _vocab(target_vocab=int(t["config"]["vocab_size"]))
    ids = torch.from_numpy(vocab.draft_ids)
    draft = build_draft(TrainConfig(), t, layer_ids=(2, 4, 5), vocab=vocab, seed=0)
    assert torch.equal(draft.lm_head.weight, t["lm_head"][ids])
    assert torch.equal(draft.norm.weight, t["norm"])
    old = build_draft(TrainConfig(init_lm_head="random", init_norm="ones"), t, layer_ids=(2, 4, 5), vocab=vocab,
                      seed=0)
    assert not torch.allclose(old.lm_head.weight, t["lm_head"][ids]) and torch.all(old.norm.weight == 1)
    # Everything else starts the same either way (same seed).
    same = {k: v for k, v in draft.state_dict().items() if not k.startswith(("lm_head.", "norm."))}
    assert all(torch.equal(v, old.state_dict()[k]) for k, v in same.items())


def test_drop_rule_removes_tokens_whose_target_top1_is_outside_the_draft_vocab():
    in_vocab = torch.zeros(10, dtype=torch.bool)
    in_vocab[[1, 2, 3]] = True
    argmax = torch.tensor([[1, 7, 2, 9, 3]])         # target top-1 at positions 0..4
    mask = torch.tensor([[False, True, True, True, True]])
    b = Batch(input_ids=torch.zeros(1, 5, dtype=torch.long), loss_mask=mask, doc_ids=torch.zeros(1, 5, dtype=torch.long),
              position_ids=torch.arange(5)[None], aux=torch.zeros(1, 5, 3), last_hidden=torch.zeros(1, 5, 1))
    out = drop_oov_positions(b, argmax, in_vocab)
    # token j is predicted from the distribution at j - 1: argmax 7 (pos 1) and 9 (pos 3) are out.
    assert out.loss_mask.tolist() == [[False, True, False, True, False]]
    assert b.loss_mask.tolist() == mask.tolist()  # the batch itself is not modified


def test_train_with_the_drop_rule_counts_fewer_positions(tmp_path, feature_store, tiny_target):
    from eaglenest.train.loop import train

    uri, version = feature_store
    counts = {}
    for rule in ("keep", "drop"):
        cfg = TrainConfig(draft_vocab_size=64, ttt_steps=2, num_steps=2, pack_tokens=256, batch_rows=2,
                          log_every_steps=1, table_version=version, oov_positions=rule, output_subdir=f"t_{rule}")
        train(cfg, store_uri=uri, workdir=str(tmp_path), target_dir=str(tiny_target), seed=0)
        rows = [json.loads(x) for x in (tmp_path / f"t_{rule}" / "metrics.jsonl").read_text().splitlines()]
        counts[rule] = sum(r["step_count"][0] for r in rows)
    assert 0 < counts["drop"] < counts["keep"]
