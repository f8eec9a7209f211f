"""Long rows: chunked attention (mask built per query chunk, recomputed in backward) equals the
dense path in loss and every gradient, with packing and padding; a long row trains."""

from __future__ import annotations

import pytest
import torch

from eaglenest.train.model import (Eagle3Draft, causal_doc_mask, chunk_doc_mask, draft_config, first_visible_key,
                                   init_weights)
from eaglenest.train.model import DraftFlags
from eaglenest.train.ttt import Batch, ttt_loss

TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu")


def make(chunk: int, window: int = 0) -> Eagle3Draft:
    cfg = draft_config(TARGET, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags(), sliding_window=window)
    cfg.attn_chunk_tokens = chunk
    m = Eagle3Draft(cfg).double()
    init_weights(m, seed=0, std=0.1)
    with torch.no_grad():
        m.d2t.copy_(torch.arange(64) * 3)
        m.embed_tokens.weight.copy_(torch.randn(256, 64, generator=torch.Generator().manual_seed(3)) * 0.1)
    return m


def batch(t: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    doc = torch.tensor([[0] * (t // 2) + [1] * (t - t // 2), [0] * (t - 7) + [-1] * 7])
    pos = torch.stack([torch.cat([torch.arange(t // 2), torch.arange(t - t // 2)]), torch.arange(t)])
    return Batch(input_ids=torch.randint(0, 256, (2, t), generator=g), loss_mask=doc >= 0, doc_ids=doc,
                 position_ids=pos, aux=torch.randn(2, t, 192, generator=g, dtype=torch.float64),
                 last_hidden=torch.randn(2, t, 64, generator=g, dtype=torch.float64))


def test_chunk_mask_rows_equal_dense():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1, -1], [0, 0, 0, 0, 0, 0, 0]])
    dense = causal_doc_mask(doc)
    for s in (0, 3, 6):
        e = min(7, s + 3)
        assert torch.equal(chunk_doc_mask(doc, s, e), dense[:, s:e, :e])
        assert not dense[:, s:e, e:].any()


@pytest.mark.parametrize("t, chunk, k, window", [(40, 16, 3, 0), (37, 8, 2, 0), (40, 16, 3, 5)])
def test_chunked_attention_matches_dense(t, chunk, k, window):
    b = batch(t)
    probs = torch.softmax(torch.randn(2, t, 64, generator=torch.Generator().manual_seed(2),
                                      dtype=torch.float64), -1)
    argmax = torch.randint(0, 256, (2, t))
    out = []
    for c in (10_000, chunk):
        m = make(c, window)
        res = ttt_loss(m, b, probs, argmax, num_steps=k, step_decay=0.8)
        res.loss.backward()
        out.append((res, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (ra, ga), (rb, gb) = out
    assert float(ra.loss) == pytest.approx(float(rb.loss), rel=1e-12)
    assert ra.step_correct == rb.step_correct and ra.step_count == rb.step_count
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("window", [0, 4, 9])
def test_first_visible_key_skips_only_masked_keys(window):
    """Keys before ``first_visible_key`` are masked for every query of the chunk (so skipping them
    changes nothing), and without a window it is the first visible key exactly; for contiguous
    documents and for doc ids that recur further on."""
    g = torch.Generator().manual_seed(window)
    docs = [torch.tensor([[0] * 7 + [1] * 5 + [2] * 9 + [3] * 3 + [-1] * 4, [0] * 20 + [1] * 8]),
            torch.randint(0, 3, (2, 28), generator=g)]  # ids that recur: not contiguous documents
    for doc in docs:
        dense = causal_doc_mask(doc, window=window)
        for s in range(0, 28, 5):
            e = min(28, s + 5)
            lo = first_visible_key(doc, s, e, window=window)
            seen = dense[:, s:e, :e].any(dim=(0, 1)).nonzero()
            assert 0 <= lo <= s and not dense[:, s:e, :lo].any() and lo <= int(seen[0, 0])
            if not window:
                assert lo == int(seen[0, 0]), (doc, s, lo)
            assert torch.equal(chunk_doc_mask(doc, s, e, window=window, key_start=lo), dense[:, s:e, lo:e])
    one = docs[0][:1]  # document 2 starts at 12; the other row's document 0 spans 0..19
    assert first_visible_key(one, 14, 19) == 12 and first_visible_key(one, 14, 19, window=2) == 13
    assert first_visible_key(docs[0], 14, 19) == 0


@pytest.mark.parametrize("window", [0, 5])
def test_skipping_masked_keys_gives_the_dense_loss_and_gradients(window):
    """Rows of several packed documents (the long recipe's case): the chunked path skips the keys
    before each chunk's documents and window, and still equals the dense path."""
    t = 48
    b = batch(t)
    doc = torch.tensor([[0] * 9 + [1] * 14 + [2] * 11 + [3] * 14, [0] * 12 + [1] * 12 + [2] * 20 + [-1] * 4])
    b = Batch(**{**b.__dict__, "doc_ids": doc, "loss_mask": doc >= 0})
    probs = torch.softmax(torch.randn(2, t, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64), -1)
    argmax = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(5))
    assert [first_visible_key(doc, s, s + 8, window=window) for s in range(0, t, 8)] == (
        [0, 0, 9, 23, 23, 24] if not window else [0, 4, 12, 23, 28, 36])  # keys skipped from the second chunk on
    out = []
    for c in (10_000, 8):
        m = make(c, window)
        res = ttt_loss(m, b, probs, argmax, num_steps=3, step_decay=0.8)
        res.loss.backward()
        out.append((res, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (ra, ga), (rb, gb) = out
    assert float(ra.loss) == pytest.approx(float(rb.loss), rel=1e-12) and ra.step_correct == rb.step_correct
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-10, atol=1e-12, msg=n)


def test_window_mask_rows():
    doc = torch.tensor([[0] * 9 + [1] * 3])
    m = causal_doc_mask(doc, window=3)[0]
    t = torch.arange(12)
    want = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < 3) & (doc[0][:, None] == doc[0][None, :])
    assert torch.equal(m, want)
    for s in (0, 5, 10):
        e = min(12, s + 4)
        assert torch.equal(chunk_doc_mask(doc, s, e, window=3), causal_doc_mask(doc, window=3)[:, s:e, :e])


@pytest.mark.parametrize("chunk", [10_000, 8])
def test_sliding_window_hides_far_positions(chunk):
    """With train.sliding_window = 4, the loss on tokens >= 20 cannot depend on positions < 10: the
    rows predicting them start at 20 - 2 - (k - 1) = 15 (k = 3 steps) and each sees its last 4
    positions; with full attention it does depend on them."""
    t = 32
    b = batch(t)
    b.doc_ids[:] = 0
    b.position_ids[:] = torch.arange(t)
    b.loss_mask[:] = False
    b.loss_mask[:, 20:] = True
    changed = Batch(**{**b.__dict__, "aux": b.aux.clone(), "input_ids": b.input_ids.clone()})
    changed.aux[:, :10] += 1.0
    changed.input_ids[:, :10] = (changed.input_ids[:, :10] + 1) % 256
    probs = torch.softmax(torch.randn(2, t, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64), -1)
    argmax = torch.randint(0, 256, (2, t))
    for window, same in ((4, True), (0, False)):
        m = make(chunk, window)
        a, c = (float(ttt_loss(m, x, probs, argmax, num_steps=3, step_decay=0.8).loss) for x in (b, changed))
        assert (a == c) is same, (window, a, c)


def test_auto_window_is_the_longest_trained_span():
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import attention_span

    assert attention_span(TrainConfig(sliding_window="auto", pack_tokens=512), [10, 88, 30]) == 88
    assert attention_span(TrainConfig(sliding_window="auto", pack_tokens=64), [10, 88, 30]) == 64  # truncated rows
    assert attention_span(TrainConfig(sliding_window=0), [10, 88]) == 0
    assert attention_span(TrainConfig(sliding_window=40), [10, 88]) == 40
