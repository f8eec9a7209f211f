"""Tests written against mutants of the training core that no test killed: each checks the behaviour from
first principles (an independent reference computation or an invariant), not the code's own numbers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.train import peagle as P, state as S, vocab as V
from eaglenest.train.checkpoint import weights_digest
from eaglenest.train.data import aux_order, plan_batches, rank_rows
from eaglenest.train.config import SelectConfig, TrainConfig
from eaglenest.train.dist import DistState
from eaglenest.train.loop import _summarise
from eaglenest.train.selection import Selector
from eaglenest.train.ttt import Batch, target_targets

sys.path.insert(0, str(Path(__file__).parent))
import test_peagle as TP  # noqa: E402  (its double-precision P-EAGLE draft and batches)


@pytest.mark.parametrize("row_tokens", [0, 40])
def test_each_epoch_packs_every_sample_once_in_its_own_seeded_order(row_tokens):
    """The module's rule: epoch e shuffles with seed + e, then fills rows greedily in that order."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 50, size=37)
    pack, fill = 32, row_tokens or 32
    orders = []
    for epoch in range(3):
        plan = plan_batches(lengths, pack_tokens=pack, batch_rows=3, seed=5, epoch=epoch, row_tokens=row_tokens)
        rows = [row for batch in plan for row in batch]
        assert all(1 <= len(batch) <= 3 for batch in plan) and all(len(b) == 3 for b in plan[:-1])
        flat = [i for row in rows for i in row]
        assert flat == np.random.default_rng(5 + epoch).permutation(len(lengths)).tolist()
        used = [sum(min(int(lengths[i]), pack) for i in row) for row in rows]
        assert all(u <= fill or len(row) == 1 for u, row in zip(used, rows))
        # Greedy: a row ends only where its next sample would not fit.
        for row, u, nxt in zip(rows, used, rows[1:]):
            assert u + min(int(lengths[nxt[0]]), pack) > fill
        orders.append(flat)
    assert orders[0] != orders[1] != orders[2]


def test_coverage_is_the_share_of_loss_tokens_inside_the_draft_vocab():
    counts = np.array([5, 0, 3, 9, 1, 2], dtype=np.int64)
    vocab = V.select_vocab(counts, 3)
    assert vocab.draft_ids.tolist() == [0, 2, 3]
    assert V.coverage(counts, vocab) == pytest.approx((5 + 3 + 9) / 20)
    assert V.coverage(np.zeros(6, dtype=np.int64), vocab) == 0.0


@pytest.mark.parametrize("layer_ids", [(5, 2, 4), (2, 4, 5), (9, 0, 3, 1), (7,)])
def test_aux_order_lists_the_stored_layers_by_ascending_id(layer_ids):
    order = aux_order(layer_ids).tolist()
    assert [layer_ids[i] for i in order] == sorted(layer_ids)
    assert sorted(order) == list(range(len(layer_ids)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_rank_rows_deals_rows_round_robin_and_only_a_rank_without_rows_is_a_ghost(world_size):
    """The module's rule: with W ranks, rank r gets rows r, r+W, ... of every global batch."""
    rows = [[10 * j, 10 * j + 1] for j in range(4)]
    dealt = []
    for rank in range(world_size):
        mine, ghost = rank_rows(rows, rank, world_size)
        want = [rows[j] for j in range(rank, len(rows), world_size)]
        assert ghost is (not want)
        assert mine == (want or rows[:1])
        dealt += want
    assert sorted(dealt) == sorted(rows)  # each row trained by exactly one rank


def test_weights_digest_tells_apart_names_dtypes_and_shapes_over_the_same_bytes():
    """The digest ties checkpoint.json to its weights: tensors with the same bytes under another name,
    dtype or shape are other weights (a layer's rows given to another layer must not pass)."""
    a, b = torch.arange(6, dtype=torch.float32), torch.arange(6, 12, dtype=torch.float32)
    base = weights_digest({"fc.weight": a, "lm_head.weight": b})
    assert weights_digest({"fc.weight": a.clone(), "lm_head.weight": b.clone()}) == base
    assert weights_digest({"fc.weight": b, "lm_head.weight": a}) != base
    assert weights_digest({"fc.weight": torch.cat([a, b[:1]]), "lm_head.weight": b[1:]}) != base  # same byte stream
    assert weights_digest({"embed.weight": a, "lm_head.weight": b}) != base
    assert weights_digest({"fc.weight": a.view(2, 3), "lm_head.weight": b}) != base
    assert weights_digest({"fc.weight": a.view(torch.int32), "lm_head.weight": b}) != base


def test_peagle_counts_no_slot_of_a_padding_anchor():
    """A row with fewer candidate anchors than train.peagle.anchors_per_row pads its anchors (at position 0,
    anchor_ok False): their slots predict nothing, so neither the loss nor its denominators count them."""
    docs, mask = [0, 0, 0, 0, 0, 0, -1, -1], [0, 0, 1, 1, 1, 1, 0, 0]
    t = len(docs)
    batch = Batch(input_ids=torch.arange(t)[None], loss_mask=torch.tensor([mask]).bool(),
                  doc_ids=torch.tensor([docs]), position_ids=torch.arange(t)[None], aux=None, last_hidden=None)
    drawn = P.sample_anchors(batch, num_anchors=5, seed=0, step=0)

    def ok(a: int, d: int) -> bool:  # depth d of anchor a predicts x_{a+2+d}: a loss token of a's document
        i = a + 2 + d
        return i < t and mask[i] == 1 and docs[i] == docs[a] and docs[a] >= 0

    real = [a for a in range(t) if ok(a, 1)]  # the candidates: every one is drawn (5 asked, 3 exist)
    assert drawn.anchors[0, drawn.anchor_ok[0]].tolist() == real and int(drawn.anchor_ok.sum()) == 3
    want = [sum(ok(a, 0) for a in range(t))] + [sum(ok(a, d) for a in real) for d in (1, 2)]
    assert P.slot_counts(drawn, 3) == want == [4, 3, 2]
    for d in (1, 2):
        assert P.slot_valid(drawn, d)[0].tolist() == [ok(a, d) for a in real] + [False, False]


def test_a_metrics_record_pools_its_window():
    """Loss and per-step losses: the mean over the window's steps; accuracy: correct over counted, pooled."""
    window = [{"loss": 2.0, "step_loss": [1.0, 3.0], "step_correct": [1, 0], "step_count": [4, 2], "tokens": 10},
              {"loss": 4.0, "step_loss": [2.0, 5.0], "step_correct": [3, 1], "step_count": [4, 0], "tokens": 6}]
    rec = _summarise(window, step=2, epoch=0, lr=1e-3, seconds=1.0, stall=0.0, tokens_per_second=1.0)
    assert rec["loss"] == 3.0 and rec["step_loss"] == [1.5, 4.0]
    assert rec["step_acc"] == [4 / 8, 1 / 2] and rec["step_count"] == [8, 2] and rec["tokens"] == 16


def test_peagle_loss_weights_depth_d_by_step_decay_to_the_d():
    """The objective is sum over depths d of train.step_decay ** d x that depth's mean loss."""
    model, head, ids = TP.peagle_model(1)
    rows = TP.to_batch(TP.make_rows(2, [[9, 8], [13], [4]], p_loss=0.9))
    batch = P.sample_anchors(rows, num_anchors=3, seed=0, step=0)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    for decay in (1.0, 0.5):
        res = P.peagle_loss(model, batch, probs, argmax, num_slots=4, step_decay=decay)
        assert len(res.step_loss) == 4 and all(x > 0 for x in res.step_loss)
        weighted = sum(decay ** d * x for d, x in enumerate(res.step_loss))
        assert float(res.loss.detach()) == pytest.approx(weighted, rel=1e-9)


def test_save_state_keeps_the_newest_states(tmp_path):
    """train.state.keep=2: after each save, the state just written and the one before it (the newest)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (2, 4, 6, 8):
        S.save_state(tmp_path, step=step, objective=model, opt=opt, sched=sched, dist=DistState(), fp={}, extra={},
                     keep=2)
        kept = sorted(p.name for p in tmp_path.glob("step_*"))
        assert kept == [f"step_{s:08d}" for s in (step - 2, step) if s >= 2]
        assert S.read_latest(tmp_path)["step"] == step


def test_a_train_key_missing_from_a_saved_fingerprint_counts_as_its_default(tmp_path):
    """A state saved before a key existed: the key is its default there (resumes under the default only)."""
    def fp(cfg):
        return S.fingerprint(cfg, table_version=1, store_uri="s3://b/x", target="org/t", seed=0)

    old = fp(TrainConfig())
    del old["train"]["oov_positions"]
    info = {"step": 3, "fingerprint": old, "path": str(tmp_path / "s")}
    assert S.resolve(info, fp(TrainConfig()), tmp_path) is info
    with pytest.raises(ConfigError, match="train.oov_positions 'keep' -> 'drop'"):
        S.resolve(info, fp(TrainConfig(oov_positions="drop")), tmp_path)


def test_a_tie_in_served_al_keeps_the_earlier_snapshot(tmp_path, peagle_draft, at_step, tiny_target):
    """selection.py: "ties keep the earlier step" (the held-out slice is small: equal AL is noise)."""
    als = {2: 2.0, 4: 2.0}

    def score(snapshot):
        return {"served_al": als[json.loads((snapshot / "checkpoint.json").read_text())["step"]], "prompts": 2}

    sel = Selector(tmp_path, cfg=SelectConfig(every_steps=2), score=score, target_dir=str(tiny_target),
                   active=True, resume_step=0)
    for step in (2, 4):
        sel.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    assert sel.best()["step"] == 2
