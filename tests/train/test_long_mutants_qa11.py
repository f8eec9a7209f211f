"""Long rows from first principles (mutation audit of the long-sequence trainer, session 54).

* A packed row of several samples trains exactly as the samples one per row: the same loss and every gradient,
  at a prime row length, dense or in query chunks of a non-divisor, with the target head and the soft
  cross-entropy in chunks of 1, of a non-divisor and of more than the row.
* A context-parallel split partitions each row: the owned parts, laid end to end, are the padded row (no token
  dropped or owned twice), each halo is the positions after its part, and the ranks' valid predictions and real
  tokens add up to the whole row's.
* A stored sample longer than ``train.pack_tokens`` is cut to its first ``pack_tokens`` tokens (docs/training.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.train.config import TrainConfig
from eaglenest.train.context_parallel import owned_valid, real_tokens, split_batch
from eaglenest.train.data import FeatureShards
from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
from eaglenest.train.ttt import Batch, TargetHead, step_valid, target_targets, ttt_loss

TARGET = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu")
VD = 48
DOCS = [37, 53, 41]  # 131 tokens: a prime row


def make(chunk: int):
    cfg = draft_config(TARGET, draft_vocab_size=VD, layer_ids=(1, 2, 3), flags=DraftFlags())
    cfg.attn_chunk_tokens = chunk
    m = Eagle3Draft(cfg).double()
    init_weights(m, seed=0, std=0.2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.d2t.copy_(torch.arange(VD) * 5)
        m.embed_tokens.weight.copy_(torch.randn(256, 32, generator=g))
    head = TargetHead(1 + 0.1 * torch.randn(32, generator=g), 2 * torch.randn(256, 32, generator=g), 1e-5).double()
    return m, head, torch.arange(VD) * 5


def samples() -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [dict(ids=torch.randint(0, 256, (n,), generator=g), loss=torch.rand(n, generator=g) < 0.8,
                 aux=torch.randn(n, 96, generator=g, dtype=torch.float64),
                 last=torch.randn(n, 32, generator=g, dtype=torch.float64)) for n in DOCS]


def as_rows(rows: list[list[dict]]) -> Batch:
    """Rows of samples, each sample its own document with positions from 0; padding doc -1."""
    width = max(sum(len(s["ids"]) for s in row) for row in rows)
    b = Batch(input_ids=torch.zeros(len(rows), width, dtype=torch.long),
              loss_mask=torch.zeros(len(rows), width, dtype=torch.bool),
              doc_ids=torch.full((len(rows), width), -1), position_ids=torch.zeros(len(rows), width, dtype=torch.long),
              aux=torch.zeros(len(rows), width, 96, dtype=torch.float64),
              last_hidden=torch.zeros(len(rows), width, 32, dtype=torch.float64))
    for r, row in enumerate(rows):
        at = 0
        for d, s in enumerate(row):
            n = len(s["ids"])
            b.input_ids[r, at:at + n], b.loss_mask[r, at:at + n] = s["ids"], s["loss"]
            b.doc_ids[r, at:at + n], b.position_ids[r, at:at + n] = d, torch.arange(n)
            b.aux[r, at:at + n], b.last_hidden[r, at:at + n] = s["aux"], s["last"]
            at += n
    return b


def loss_and_grads(batch: Batch, *, attn_chunk: int, target_chunk: int, k: int = 3):
    model, head, ids = make(attn_chunk)
    probs, argmax = target_targets(head, batch.last_hidden, ids, chunk_tokens=target_chunk)
    res = ttt_loss(model, batch, probs, argmax, num_steps=k, step_decay=0.7, chunk_tokens=target_chunk)
    res.loss.backward()
    return res, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attn_chunk, target_chunk", [(10_000, 0), (16, 0), (10_000, 1), (16, 23), (7, 1000)])
def test_a_packed_row_trains_as_its_samples_one_per_row(attn_chunk, target_chunk):
    s = samples()
    packed = as_rows([s])
    assert packed.input_ids.shape == (1, 131) and packed.position_ids[0, 37] == 0 and packed.position_ids[0, 90] == 0
    alone = as_rows([[x] for x in s])  # three rows, padded to the longest
    (rp, gp), (ra, ga) = (loss_and_grads(b, attn_chunk=attn_chunk, target_chunk=target_chunk) for b in (packed, alone))
    assert rp.step_count == ra.step_count and sum(rp.step_count) > 0
    assert rp.step_correct == ra.step_correct
    assert float(rp.loss) == pytest.approx(float(ra.loss), rel=1e-10)
    assert gp.keys() == ga.keys() and "fc.weight" in gp
    for n in gp:
        torch.testing.assert_close(gp[n], ga[n], rtol=1e-9, atol=1e-12, msg=n)
    # The samples' predictions never count a token of the next sample: the per-step counts are the samples' own.
    want = [sum(int(x["loss"][2 + j:].sum()) for x in s) for j in range(3)]
    assert rp.step_count == want


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("t", [1, 2, 45, 131])
def test_a_context_parallel_split_partitions_the_row(size, t):
    halo = 4
    g = torch.Generator().manual_seed(t)
    doc = torch.stack([torch.arange(t) // 17, torch.where(torch.arange(t) < t - t // 3, 0, -1)])
    batch = Batch(input_ids=torch.randint(1, 256, (2, t), generator=g), loss_mask=(torch.rand(2, t, generator=g) < 0.7)
                  & (doc >= 0), doc_ids=doc, position_ids=torch.arange(t).repeat(2, 1) % 17,
                  aux=torch.randn(2, t, 6, generator=g), last_hidden=torch.randn(2, t, 3, generator=g))
    parts = [split_batch(batch, rank=r, size=size, halo=halo) for r in range(size)]
    n = parts[0].shard.num_tokens
    assert n == -(-t // size) and [p.shard.start for p in parts] == [r * n for r in range(size)]
    for f in dataclasses.fields(Batch):
        whole = getattr(batch, f.name)
        owned = torch.cat([getattr(p, f.name)[:, :n] for p in parts], dim=1)
        assert torch.equal(owned[:, :t], whole), f.name  # every token once, in order
        assert not owned[:, t:].any() if f.name != "doc_ids" else (owned[:, t:] == -1).all()
        for r, p in enumerate(parts):  # the halo: the positions right after the part (padding past the row)
            after = owned[:, (r + 1) * n:(r + 1) * n + halo]
            assert torch.equal(getattr(p, f.name)[:, n:n + after.shape[1]], after), (f.name, r)
    for p in parts:
        assert torch.equal(p.shard.doc_ids, torch.cat([q.doc_ids[:, :n] for q in parts], dim=1))
    assert sum(real_tokens(p) for p in parts) == int((batch.doc_ids >= 0).sum())
    for k in range(halo - 1):
        assert sum(int(owned_valid(p, k).sum()) for p in parts) == int(step_valid(batch, k).sum()), k


def test_a_sample_longer_than_pack_tokens_is_cut_to_its_first_pack_tokens(tmp_path, synth, tiny_target):
    g = torch.Generator().manual_seed(2)
    long_ids = torch.randint(3, 2048, (61,), generator=g).tolist()
    short_ids = torch.randint(3, 2048, (9,), generator=g).tolist()
    uri = str(tmp_path / "store")
    synth.write_features(uri, tiny_target, [(long_ids, [0] * 4 + [1] * 57), (short_ids, [0] * 2 + [1] * 7)])
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=40, batch_rows=2, seed=0)
    try:
        rows = [row for batch in shards.plan(0) for row in batch]
        assert sorted(len(r) for r in rows) == [1, 1]  # 40 + 9 > 40: a row each
        batch = shards.read(rows)
    finally:
        shards.close()
    r = [b for b in range(2) if int((batch.doc_ids[b] >= 0).sum()) == 40]
    assert len(r) == 1, batch.doc_ids
    b = r[0]
    assert batch.input_ids.shape[1] == 40
    assert batch.input_ids[b].tolist() == long_ids[:40]
    assert batch.position_ids[b].tolist() == list(range(40)) and (batch.doc_ids[b] == 0).all()
    assert batch.loss_mask[b].tolist() == [False] * 4 + [True] * 36
    other = 1 - b
    assert batch.input_ids[other, :9].tolist() == short_ids and (batch.doc_ids[other, 9:] == -1).all()


def test_row_tokens_equal_to_pack_tokens_is_the_default_fill():
    """docs/training.md: row_tokens 0 means pack_tokens, and the two spellings resume each other: both accepted."""
    assert TrainConfig(pack_tokens=512, row_tokens=512).row_tokens == 512
    with pytest.raises(ConfigError, match=r"^train.row_tokens: 513 exceeds train.pack_tokens=512"):
        TrainConfig(pack_tokens=512, row_tokens=513)


@pytest.mark.parametrize("value", [0, -1])
def test_an_attention_chunk_of_no_tokens_is_refused(value):
    """The chunk is a number of query tokens: 0 would be read as the default 2048 by the draft, silently."""
    with pytest.raises(ConfigError, match=r"^train.attn_chunk_tokens") as err:
        TrainConfig(attn_chunk_tokens=value)
    assert "\n" not in str(err.value)
    assert TrainConfig(attn_chunk_tokens=1).attn_chunk_tokens == 1
