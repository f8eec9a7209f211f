"""Tests written against mutants of the P-EAGLE / DFlash training code that no test killed (QA 11): each
checks the behaviour from first principles (an independent reference computation or an invariant)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from eaglenest.train import dflash as D, peagle as P
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig
from eaglenest.train.model import draft_config, DraftFlags
from eaglenest.train.ttt import step_valid, target_targets

sys.path.insert(0, str(Path(__file__).parent))
import test_dflash as TD  # noqa: E402  (its double-precision DFlash draft and plain-ops reference round)
import test_peagle as TP  # noqa: E402  (its double-precision P-EAGLE draft and batches)

K = 4


def _rows(batch, rows: slice):
    """The rows ``rows`` of a (P-EAGLE or DFlash) batch, every field sliced alike."""
    return type(batch)(**{f.name: getattr(batch, f.name)[rows] for f in dataclasses.fields(batch)})


def _peagle_batch():
    model, head, ids = TP.peagle_model(1)
    batch = P.sample_anchors(TP.to_batch(TP.make_rows(2, [[14], [13], [10, 6]], p_loss=0.9)), num_anchors=3,
                             seed=0, step=0)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    return model, batch, probs, argmax


def _dflash_batch():
    model, head, ids = TD.dflash_model(3, layers=2, block_size=K)
    batch = D.sample_anchors(TD.to_batch(TD.make_rows(2, [[14], [13], [10, 6]], p_loss=0.9)), num_anchors=3,
                             seed=0, step=0)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    return model, batch, probs, argmax


def _loss(family: str, model, batch, probs, argmax, denominators=None):
    if family == "peagle":
        return P.peagle_loss(model, batch, probs, argmax, num_slots=K, step_decay=0.8, denominators=denominators)
    return D.dflash_loss(model, batch, probs, argmax, block_size=K, step_decay=0.8, denominators=denominators)


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_ranks_losses_with_the_global_denominators_sum_to_the_whole_batchs_loss(family):
    """Data parallelism's invariant: each rank divides by the GLOBAL per-depth counts, so the ranks'
    losses (and gradients) add up to the loss of the whole batch on one rank."""
    model, batch, probs, argmax = _peagle_batch() if family == "peagle" else _dflash_batch()
    whole = _loss(family, model, batch, probs, argmax)
    parts = [_loss(family, model, _rows(batch, s), probs[s], argmax[s], denominators=whole.step_count)
             for s in (slice(0, 1), slice(1, 3))]
    assert min(p.step_count[-1] for p in parts) > 0  # every depth has valid predictions on both "ranks"
    assert [a + b for a, b in zip(*(p.step_count for p in parts))] == whole.step_count
    assert float(sum(p.loss for p in parts)) == pytest.approx(float(whole.loss), rel=1e-9)
    assert [a + b for a, b in zip(*(p.step_correct for p in parts))] == whole.step_correct


def test_peagle_step_correct_counts_each_depths_exact_top1_hits():
    """step_correct[d]: valid predictions of depth d whose draft argmax (as a target id) is the target's
    argmax for the token that depth predicts (x_{t+2} at depth 0; x_{a+2+d} at slot d of anchor a)."""
    model, batch, probs, argmax = _peagle_batch()
    res = _loss("peagle", model, batch, probs, argmax)
    normed = P.peagle_forward(model, batch, K)
    t = batch.input_ids.shape[1]
    top = model.draft_to_target(model.logits(normed).argmax(-1))
    want = [0] * K
    for r in range(batch.input_ids.shape[0]):
        for p in range(t):
            if step_valid(batch, 0)[r, p]:
                want[0] += int(top[r, p] == argmax[r, p + 1])
        for i, (a, ok) in enumerate(zip(batch.anchors[r].tolist(), batch.anchor_ok[r].tolist())):
            for d in range(1, K):
                if ok and step_valid(batch, d)[r, a]:
                    want[d] += int(top[r, t + i * (K - 1) + d - 1] == argmax[r, a + 1 + d])
    # The draft is random: hits are rare, so count the misses too (a mask dropped would count invalid slots).
    assert res.step_correct == want
    assert res.step_count == [int(step_valid(batch, 0).sum())] + [
        int((step_valid(batch, d).gather(1, batch.anchors) & batch.anchor_ok).sum()) for d in range(1, K)]
    # With the target's own argmax as the draft's answer every valid prediction is a hit: the counts match.
    rigged = argmax.clone()
    for r in range(batch.input_ids.shape[0]):
        for p in range(t):
            if step_valid(batch, 0)[r, p]:
                rigged[r, p + 1] = top[r, p]
    hits = _loss("peagle", model, batch, probs, rigged).step_correct[0]
    assert hits == res.step_count[0]


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_a_draft_that_always_hits_counts_exactly_its_valid_predictions(family):
    """A draft whose every prediction is the target's answer (lm_head zero: argmax draft id 0 everywhere,
    and the target's argmax that id's target id everywhere): step_correct is step_count at every depth.
    Slots that predict nothing (past a document's end, padding anchors) are no hits."""
    model, batch, probs, argmax = _peagle_batch() if family == "peagle" else _dflash_batch()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    rigged = torch.full_like(argmax, int(model.draft_to_target(torch.tensor([0]))[0]))
    res = _loss(family, model, batch, probs, rigged)
    assert res.step_correct == res.step_count and min(res.step_count) > 0
    assert int((~batch.anchor_ok).sum()) + int(batch.anchor_ok.sum()) * (K - 1) > sum(res.step_count[-(K - 1):])


def test_peagle_propose_is_vllms_one_causal_round():
    """``propose`` (the offline replay of vLLM's parallel drafting): ONE plain causal pass over the
    depth-0 inputs (token seq[i+1], hidden feats[i], position i) and k-1 mask slots (mask token,
    fc(mask_hidden), positions t, t+1, ...); its proposals are the argmaxes at rows t-1 .. t+k-2."""
    model, _head, _ids = TP.peagle_model(2)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, TP.V, (9,), generator=g).tolist()
    t = len(seq) - 1
    feats = model.combine(torch.randn(t, model.fc.in_features, generator=g, dtype=torch.float64))
    for k in (1, 2, K):
        tokens = torch.tensor([seq[1:] + [TP.MASK_ID] * (k - 1)])
        hidden = torch.cat([feats, model.combine(model.mask_hidden).expand(k - 1, -1)])[None]
        n = t + k - 1
        normed, _ = model.step(tokens, hidden, torch.arange(n)[None], [], torch.ones(1, n, n, dtype=torch.bool).tril())
        want = model.draft_to_target(model.logits(normed[0, t - 1:]).argmax(-1)).tolist()
        assert P.propose(model, seq, feats, k) == want and len(want) == k


def test_dflash_propose_is_vllms_block_round():
    """``propose`` for DFlash: the block [seq[-1], mask x k] at positions t..t+k over the context of
    seq[:-1], computed by test_dflash's plain-ops reference; its proposals are slots 1..k (over enough
    requests that a block one position off, or the wrong slots, changes some proposal)."""
    model, _head, _ids = TD.dflash_model(4, layers=2, block_size=K)
    g = torch.Generator().manual_seed(1)
    for n in range(2, 14):
        seq = torch.randint(0, TD.V, (n,), generator=g).tolist()
        t = len(seq) - 1
        aux = torch.randn(1, t + 1, model.fc.in_features, generator=g, dtype=torch.float64)
        one = torch.zeros(1, t + 1, dtype=torch.long)
        for k in (1, K - 1):
            batch = D.DFlashBatch(input_ids=torch.tensor([seq]), loss_mask=one.bool(), doc_ids=one,
                                  position_ids=torch.arange(t + 1)[None], aux=aux, last_hidden=None,
                                  anchors=torch.tensor([[t]]), anchor_ok=torch.ones(1, 1, dtype=torch.bool))
            ref = TD._vllm_round(model, batch, 0, t, k + 1)
            want = model.draft_to_target(model.logits(ref[1:]).argmax(-1)).tolist()
            assert D.propose(model, seq, model.context(aux[0, :t]), k) == want and len(want) == k


def test_each_family_trains_and_records_its_own_depth():
    """The depth the trainer unrolls (``num_steps``) and the one the draft records for export are the
    family's own key: P-EAGLE ``num_slots``, DFlash ``block_size`` (- 1 predictions), never ttt_steps."""
    cfg = TrainConfig(family="peagle", ttt_steps=5, peagle=PEagleConfig(num_slots=3))
    assert P.num_steps(cfg) == 3 and P.num_steps(dataclasses.replace(cfg, family="eagle3")) == 5
    assert D.num_steps(TrainConfig(family="dflash", dflash=DFlashConfig(block_size=6))) == 5
    target = {**TD.TARGET_CFG, "pad_token_id": 1}
    d = draft_config(target, draft_vocab_size=TD.VD, layer_ids=(1, 2, 3), flags=DraftFlags())
    P.configure(d, PEagleConfig(num_slots=3, mask_token_id=7), target)
    assert (d.peagle_num_slots, d.mask_token_id, d.parallel_drafting) == (3, 7, True)
    d = draft_config(target, draft_vocab_size=TD.VD, layer_ids=(1, 2, 3), flags=DraftFlags())
    D.configure(d, DFlashConfig(num_layers=2, block_size=6), target)
    assert (d.dflash_block_size, d.num_hidden_layers, d.mask_token_id, d.dflash) == (6, 2, 1, True)


def test_peagle_loss_in_target_chunks_is_the_plain_loss():
    """``train.target_chunk_tokens``: depth 0's loss computed chunk by chunk (ChunkedSoftCE) is the
    plain soft cross-entropy at the target's distribution for x_{t+2}: loss, per-depth figures and
    gradients agree."""
    model, batch, probs, argmax = _peagle_batch()
    grads = []
    results = []
    for chunk in (0, 8):
        model.zero_grad()
        res = P.peagle_loss(model, batch, probs, argmax, num_slots=K, step_decay=0.8, chunk_tokens=chunk)
        res.loss.backward()
        results.append(res)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    plain, chunked = results
    assert batch.input_ids.numel() > 8  # the chunked path ran
    assert float(chunked.loss) == pytest.approx(float(plain.loss), rel=1e-9)
    assert chunked.step_loss == pytest.approx(plain.step_loss, rel=1e-9)
    assert (chunked.step_correct, chunked.step_count) == (plain.step_correct, plain.step_count)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)
