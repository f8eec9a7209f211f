"""QA of the parallel drafters (P-EAGLE, DFlash), fifth pass: packed samples never see each other,
hostile rows train with finite losses and exact counts, and the default mask token is one of the
target's vocabulary or one line naming what the target's config holds."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.train import dflash as D
from eaglenest.train import peagle as P
from eaglenest.train.config import DFlashConfig, PEagleConfig
from eaglenest.train.ttt import Batch, step_valid, target_targets


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_eaglenest_test_qa5_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_pe, _df = _load("test_peagle"), _load("test_dflash")
_ttt = _pe._ttt
TARGET_CFG, V = _ttt.TARGET_CFG, _ttt.V


def _docs(seed: int, lengths: list[int], loss: list[bool] | None = None) -> list[dict]:
    """Documents of ``lengths`` (random tokens and features), all loss tokens after the first
    unless ``loss`` (one flag per document) switches a document's loss off."""
    row = _ttt.make_rows(seed, [lengths], p_loss=1.0)[0]
    for i, doc in enumerate(row):
        doc["loss_mask"] = [False] + [bool(loss[i]) if loss else True] * (len(doc["ids"]) - 1)
    return row


def _anchored(cls, row: list[dict], anchors: list[int]):
    batch = _ttt.to_batch([row])
    return cls(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(Batch)},
               anchors=torch.tensor([anchors]), anchor_ok=torch.ones(1, len(anchors), dtype=torch.bool))


# -- no attention across packed samples ------------------------------------------------------------

def _peagle_b(model, head, ids, first: list[dict], second: dict, b_anchors: list[int], k: int):
    """P-EAGLE on one row [first docs ; second] with anchors at b_anchors (positions inside the
    second document) and one anchor in each first document: the second document's depth-0 outputs,
    its anchors' slot outputs, the loss (the first docs carry no loss tokens) and fc's gradient."""
    off = sum(len(d["ids"]) for d in first)
    starts = [sum(len(d["ids"]) for d in first[:i]) for i in range(len(first))]
    anchors = [s + 1 for s in starts] + [off + a for a in b_anchors]
    batch = _anchored(P.PEagleBatch, [*first, second], anchors)
    model.zero_grad()
    normed = P.peagle_forward(model, batch, k)
    t = batch.input_ids.shape[1]
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = P.peagle_loss(model, batch, probs, argmax, num_slots=k, step_decay=0.8)
    res.loss.backward()
    slots = normed[0, t + len(first) * (k - 1):]
    return normed[0, off:t].detach(), slots.detach(), res, model.fc.weight.grad.clone()


def test_a_peagle_sample_is_blind_to_the_samples_packed_before_it():
    """Changing (or shortening) the sample packed before another changes nothing of the other: its
    depth-0 outputs, its anchors' slots, its loss and the gradient (a leak through the slot mask,
    the context of a slot or the rotary positions would move them)."""
    model, head, ids = _pe.peagle_model(1)
    second = _docs(7, [12])[0]
    k = 4
    ref = _peagle_b(model, head, ids, _docs(1, [9], loss=[False]), second, [2, 6], k)
    for other in (_docs(2, [9], loss=[False]), _docs(3, [5, 3], loss=[False, False])):
        got = _peagle_b(model, head, ids, other, second, [2, 6], k)
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])
        assert got[2].step_count == ref[2].step_count and got[2].step_count[1] == 2
        assert float(got[2].loss) == pytest.approx(float(ref[2].loss), rel=1e-12)
        torch.testing.assert_close(got[3], ref[3])
    # The comparison sees a change of the sample itself (it is not blind to everything).
    moved = _peagle_b(model, head, ids, _docs(1, [9], loss=[False]), _docs(8, [12])[0], [2, 6], k)
    assert (moved[1] - ref[1]).abs().max() > 1e-3


def _dflash_b(model, head, ids, first: list[dict], second: dict, b_anchors: list[int], bs: int):
    off = sum(len(d["ids"]) for d in first)
    starts = [sum(len(d["ids"]) for d in first[:i]) for i in range(len(first))]
    anchors = [s + 1 for s in starts] + [off + a for a in b_anchors]
    batch = _anchored(D.DFlashBatch, [*first, second], anchors)
    model.zero_grad()
    normed = D.dflash_forward(model, batch, bs)[0].view(len(anchors), bs, -1)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = D.dflash_loss(model, batch, probs, argmax, block_size=bs, step_decay=0.8)
    res.loss.backward()
    return normed[len(first):].detach(), res, model.fc.weight.grad.clone()


def test_a_dflash_block_is_blind_to_the_samples_packed_before_it():
    """As for P-EAGLE: the second sample's blocks, loss and gradient do not move when the sample
    packed before it changes or is shorter (context keys, block keys, rotary positions)."""
    model, head, ids = _df.dflash_model(3, layers=2, block_size=4)
    second = _docs(7, [12])[0]
    ref = _dflash_b(model, head, ids, _docs(1, [9], loss=[False]), second, [2, 6], 4)
    for other in (_docs(2, [9], loss=[False]), _docs(3, [5, 3], loss=[False, False])):
        got = _dflash_b(model, head, ids, other, second, [2, 6], 4)
        torch.testing.assert_close(got[0], ref[0])
        assert got[1].step_count == ref[1].step_count == [2, 2, 2]
        assert float(got[1].loss) == pytest.approx(float(ref[1].loss), rel=1e-12)
        torch.testing.assert_close(got[2], ref[2])
    moved = _dflash_b(model, head, ids, _docs(1, [9], loss=[False]), _docs(8, [12])[0], [2, 6], 4)
    assert (moved[0] - ref[0]).abs().max() > 1e-3


# -- hostile rows ----------------------------------------------------------------------------------

HOSTILE = {
    "one loss token": [[6]],                 # the first doc's loss mask is cut to its last token below
    "shorter than a block": [[3], [2, 2]],
    "single-token documents": [[1, 1, 1, 4]],
    "padding only past one token": [[1], [9]],
}


def _hostile_batch(layout: list[list[int]]) -> Batch:
    batch = _ttt.to_batch(_ttt.make_rows(5, layout, p_loss=1.0))
    first = batch.doc_ids[0] == 0
    last = int(first.nonzero().max())
    batch.loss_mask[0, first] = False
    batch.loss_mask[0, last] = True  # row 0, document 0: exactly one loss token, its last
    return batch


@pytest.mark.parametrize("layout", list(HOSTILE))
def test_peagle_on_hostile_rows_counts_exactly_and_stays_finite(layout):
    """More anchors and slots than a row has loss tokens: every depth's count is the plain count of
    its valid predictions, a depth with none weighs nothing, the loss and every gradient are finite."""
    model, head, ids = _pe.peagle_model(2)
    batch = P.sample_anchors(_hostile_batch(HOSTILE[layout]), num_anchors=64, seed=0, step=1)
    k = 6
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = P.peagle_loss(model, batch, probs, argmax, num_slots=k, step_decay=0.8)
    plain = [0] * k
    for r in range(batch.input_ids.shape[0]):
        for a, ok in zip(batch.anchors[r].tolist(), batch.anchor_ok[r].tolist()):
            for d in range(1, k):
                plain[d] += int(ok and bool(step_valid(batch, d)[r, a]))
    plain[0] = int(step_valid(batch, 0).sum())
    assert res.step_count == plain
    assert all(loss == 0.0 for loss, n in zip(res.step_loss, plain) if n == 0)
    res.loss.backward()
    assert torch.isfinite(res.loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)  # the loss reached the weights, finite


@pytest.mark.parametrize("layout", list(HOSTILE))
def test_dflash_on_hostile_rows_counts_exactly_and_stays_finite(layout):
    model, head, ids = _df.dflash_model(4, layers=1, block_size=8)
    batch = D.sample_anchors(_hostile_batch(HOSTILE[layout]), num_anchors=64, seed=0, step=1)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = D.dflash_loss(model, batch, probs, argmax, block_size=8, step_decay=0.8)
    plain = [0] * 7
    for r in range(batch.input_ids.shape[0]):
        doc = batch.doc_ids[r]
        for p, ok in zip(batch.anchors[r].tolist(), batch.anchor_ok[r].tolist()):
            for k in range(1, 8):
                q = p + k
                plain[k - 1] += int(ok and q < doc.shape[0] and doc[q] == doc[p] and bool(batch.loss_mask[r, q]))
    assert res.step_count == plain
    assert all(loss == 0.0 for loss, n in zip(res.step_loss, plain) if n == 0)
    res.loss.backward()
    assert torch.isfinite(res.loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)  # the loss reached the weights, finite


# -- the default mask token ------------------------------------------------------------------------

@pytest.mark.parametrize("family, key", [(P, "train.peagle.mask_token_id"), (D, "train.dflash.mask_token_id")])
def test_the_default_mask_token_is_a_token_of_the_vocabulary_or_names_what_the_target_holds(family, key):
    """A target whose pad_token_id is past its vocabulary (a pad added after the vocabulary was sized)
    and whose eos ids are [past it, 7]: the null mask token was refused as "the target's config has no
    pad_token_id or eos_token_id" (it has both) though eos 7 is a token of the vocabulary; a pad_token_id
    of ``true`` was read as token 1. The first id of the vocabulary is used; none: the line names them."""
    cfg = DFlashConfig() if family is D else PEagleConfig()
    assert family.mask_token_id(cfg, {**TARGET_CFG, "pad_token_id": V, "eos_token_id": [V + 1, 7]}) == 7
    assert family.mask_token_id(cfg, {**TARGET_CFG, "pad_token_id": True, "eos_token_id": 9}) == 9
    assert family.mask_token_id(cfg, {**TARGET_CFG, "pad_token_id": 3, "eos_token_id": 9}) == 3  # pad first
    with pytest.raises(ConfigError) as err:
        family.mask_token_id(cfg, {**TARGET_CFG, "pad_token_id": V, "eos_token_id": None})
    assert str(err.value) == (f"{key}: null, and the target's config names no token id of its vocabulary (size {V}) "
                              f"to use (pad_token_id {V}, eos_token_id None); set a token id of its vocabulary")
