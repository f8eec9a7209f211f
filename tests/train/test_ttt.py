"""The batched TTT objective equals the plain loop reference (loss, counts, accuracy, gradients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglenest.train.model import DraftFlags, Eagle3Draft, causal_doc_mask, draft_config, init_weights
from eaglenest.train.ttt import Batch, TargetHead, target_targets, ttt_loss

H, V, VD, N_AUX = 32, 64, 40, 3
TARGET_CFG = dict(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=256, vocab_size=V,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_model(seed: int, flags: DraftFlags = DraftFlags()):
    g = torch.Generator().manual_seed(seed)
    cfg = draft_config(TARGET_CFG, draft_vocab_size=VD, layer_ids=(1, 2, 3), flags=flags)
    model = Eagle3Draft(cfg).double()
    init_weights(model, seed=seed, std=0.3)
    ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
        for name, p in model.named_parameters():  # non-trivial norm weights
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        model.d2t.copy_(ids - torch.arange(VD))
    head = TargetHead(1 + 0.1 * torch.randn(H, generator=g), torch.randn(V, H, generator=g), 1e-6).double()
    return model, head, ids


def make_rows(seed: int, layout: list[list[int]], p_loss: float = 0.7):
    """layout: per row, the document lengths packed into it."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for docs in layout:
        row = []
        for T in docs:
            row.append(dict(ids=torch.randint(0, V, (T,), generator=g).tolist(),
                            loss_mask=(torch.rand(T, generator=g) < p_loss).tolist(),
                            aux=torch.randn(T, N_AUX * H, generator=g, dtype=torch.float64),
                            last=torch.randn(T, H, generator=g, dtype=torch.float64)))
        rows.append(row)
    return rows


def to_batch(rows) -> Batch:
    width = max(sum(len(d["ids"]) for d in row) for row in rows)
    B = len(rows)
    b = Batch(input_ids=torch.zeros(B, width, dtype=torch.long), loss_mask=torch.zeros(B, width, dtype=torch.bool),
              doc_ids=torch.full((B, width), -1), position_ids=torch.zeros(B, width, dtype=torch.long),
              aux=torch.zeros(B, width, N_AUX * H, dtype=torch.float64),
              last_hidden=torch.zeros(B, width, H, dtype=torch.float64))
    for r, row in enumerate(rows):
        o = 0
        for d, doc in enumerate(row):
            T = len(doc["ids"])
            b.input_ids[r, o:o + T] = torch.tensor(doc["ids"])
            b.loss_mask[r, o:o + T] = torch.tensor(doc["loss_mask"])
            b.doc_ids[r, o:o + T] = d
            b.position_ids[r, o:o + T] = torch.arange(T)
            b.aux[r, o:o + T] = doc["aux"]
            b.last_hidden[r, o:o + T] = doc["last"]
            o += T
    return b


LAYOUTS = {
    "single": [[9]],
    "padded": [[7], [12], [3]],
    "packed": [[5, 6], [4, 3, 5]],
    "packed+padded": [[6, 2], [11], [3]],
}


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("flags", [DraftFlags(), DraftFlags(norm_before_fc=True, fc_norm=True,
                                                            norm_before_residual=True, norm_output=True)],
                         ids=["eagle3", "eagle3.1"])
def test_fast_matches_reference(reference, K, layout, flags):
    seed = 100 * K + 10 * list(LAYOUTS).index(layout) + int(flags.norm_output)
    model, head, ids = make_model(seed, flags)
    rows = make_rows(seed, LAYOUTS[layout])
    batch = to_batch(rows)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    fast = ttt_loss(model, batch, probs.double(), argmax, num_steps=K, step_decay=0.8)
    fast.loss.backward()
    g_fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    head64 = lambda h: head.lm_head(head.norm(h))  # noqa: E731
    ref_loss, ref_count, ref_correct = reference.reference_ttt(
        model, head64, rows, draft_target_ids=ids, num_steps=K, step_decay=0.8)
    ref_loss.backward()
    assert fast.step_count == ref_count
    assert sum(ref_count) > 0
    assert fast.step_correct == ref_correct
    torch.testing.assert_close(fast.loss.detach(), ref_loss.detach(), rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(g_fast[n], p.grad, rtol=0, atol=1e-5, msg=n)


def test_fp32_matches_reference(reference):
    """The same equivalence in fp32 (the training dtype), at 1e-5."""
    model, head, ids = make_model(3)
    model, head = model.float(), head.float()
    rows = make_rows(3, [[6, 5], [8]])
    for doc in (d for r in rows for d in r):
        doc["aux"], doc["last"] = doc["aux"].float(), doc["last"].float()
    batch = to_batch(rows)
    batch.aux, batch.last_hidden = batch.aux.float(), batch.last_hidden.float()
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    fast = ttt_loss(model, batch, probs, argmax, num_steps=3, step_decay=0.8)
    fast.loss.backward()
    g_fast = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    ref_loss, _, _ = reference.reference_ttt(model, head, rows, draft_target_ids=ids, num_steps=3,
                                             step_decay=0.8)
    ref_loss.backward()
    torch.testing.assert_close(fast.loss.detach(), ref_loss.detach(), rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(g_fast[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_packing_blocks_cross_document_attention():
    """Changing document A must not change any loss term of document B packed after it."""
    model, head, ids = make_model(5)
    rows = make_rows(5, [[6, 7]], p_loss=1.0)
    base = to_batch(rows)
    rows[0][0]["aux"] = rows[0][0]["aux"] + 1.0
    rows[0][0]["ids"] = [(i + 1) % V for i in rows[0][0]["ids"]]
    changed = to_batch(rows)
    # Only doc B (positions 6..12) scores: zero doc A's loss mask in both.
    for b in (base, changed):
        b.loss_mask[0, :6] = False
    outs = []
    for b in (base, changed):
        probs, argmax = target_targets(head, b.last_hidden, ids)
        outs.append(ttt_loss(model, b, probs, argmax, num_steps=3, step_decay=0.8).loss)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)


def test_mask_is_causal_and_per_document():
    doc = torch.tensor([[0, 0, 1, 1, -1]])
    m = causal_doc_mask(doc)[0]
    assert m[1, 0] and not m[0, 1]          # causal
    assert not m[2, 1] and m[3, 2]          # no cross-document
    assert m[4, 4] and not m[4, 3]          # padding sees itself only among real keys' rows
    assert np.array_equal(m.diagonal().numpy(), np.ones(5, dtype=bool))
