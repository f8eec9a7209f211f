"""Long rows: chunked attention (mask built per query chunk, recomputed in backward) equals the
dense path in loss and every gradient, with packing and padding; a long row trains."""

from __future__ import annotations

import pytest
import torch

from eaglenest.train.model import Eagle3Draft, causal_doc_mask, chunk_doc_mask, draft_config, init_weights
from eaglenest.train.model import DraftFlags
from eaglenest.train.ttt import Batch, ttt_loss

TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu")


def make(chunk: int) -> Eagle3Draft:
    cfg = draft_config(TARGET, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags())
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


@pytest.mark.parametrize("t, chunk, k", [(40, 16, 3), (37, 8, 2)])
def test_chunked_attention_matches_dense(t, chunk, k):
    b = batch(t)
    probs = torch.softmax(torch.randn(2, t, 64, generator=torch.Generator().manual_seed(2),
                                      dtype=torch.float64), -1)
    argmax = torch.randint(0, 256, (2, t))
    out = []
    for c in (10_000, chunk):
        m = make(c)
        res = ttt_loss(m, b, probs, argmax, num_steps=k, step_decay=0.8)
        res.loss.backward()
        out.append((res, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (ra, ga), (rb, gb) = out
    assert float(ra.loss) == pytest.approx(float(rb.loss), rel=1e-12)
    assert ra.step_correct == rb.step_correct and ra.step_count == rb.step_count
    assert ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-10, atol=1e-12, msg=n)
