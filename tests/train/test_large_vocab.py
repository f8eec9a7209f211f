"""Large vocabularies: the chunked target distribution and chunked draft loss (train.target_chunk_tokens)
equal the plain path (loss, counts, accuracy, every gradient), and their memory is bounded by
construction: no op makes a full-vocabulary tensor for more than one chunk of positions, and each
TTT step keeps one [B, T, Vd] tensor for backward instead of two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eaglenest.errors import ConfigError
from eaglenest.train.config import StateConfig, TrainConfig
from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
from eaglenest.train.ttt import Batch, ChunkedSoftCE, TargetHead, shift, target_targets, ttt_loss

H, V, VD = 32, 1000, 80  # VD differs from 3 * H, so saved aux tensors never look like vocab ones
TARGET = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, max_position_embeddings=512, hidden_act="silu")


def make(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(draft_config(TARGET, draft_vocab_size=VD, layer_ids=(1, 2, 3), flags=DraftFlags())).to(dtype)
    init_weights(model, seed=seed, std=0.3)
    ids = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(V, H, generator=g))
        model.d2t.copy_(ids - torch.arange(VD))
    # A peaky target (large logits) so the top-1 check and the soft targets are both non-trivial.
    head = TargetHead(1 + 0.1 * torch.randn(H, generator=g), 3 * torch.randn(V, H, generator=g), 1e-6).to(dtype)
    return model, head, ids


def batch(dtype: torch.dtype, seed: int = 1) -> Batch:
    """Two rows: two packed documents, and one document followed by padding."""
    g = torch.Generator().manual_seed(seed)
    t = 29
    doc = torch.tensor([[0] * 12 + [1] * 17, [0] * 22 + [-1] * 7])
    pos = torch.stack([torch.cat([torch.arange(12), torch.arange(17)]), torch.arange(t)])
    return Batch(input_ids=torch.randint(0, V, (2, t), generator=g), loss_mask=(doc >= 0) & (torch.rand(2, t, generator=g) < 0.8),
                 doc_ids=doc, position_ids=pos, aux=torch.randn(2, t, 3 * H, generator=g, dtype=dtype),
                 last_hidden=torch.randn(2, t, H, generator=g, dtype=dtype))


def run(dtype, chunk: int, k: int, denominators=None):
    model, head, ids = make(dtype)
    b = batch(dtype)
    probs, argmax = target_targets(head, b.last_hidden, ids, chunk_tokens=chunk)
    res = ttt_loss(model, b, probs, argmax, num_steps=k, step_decay=0.8, chunk_tokens=chunk,
                   denominators=denominators)
    res.loss.backward()
    return res, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 7, 29, 57])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_targets_chunked_equal(chunk, dtype):
    _, head, ids = make(dtype)
    b = batch(dtype)
    p0, a0 = target_targets(head, b.last_hidden, ids)
    p1, a1 = target_targets(head, b.last_hidden, ids, chunk_tokens=chunk)
    assert p1.shape == p0.shape == (2, 29, VD) and p1.dtype == p0.dtype
    assert torch.equal(a1, a0)
    # A probability's relative error is its logit's absolute error: logits here reach ~60, so fp32
    # rounding of a differently blocked matmul (chunk 1 is a matrix-vector product) moves p by ~1e-4.
    torch.testing.assert_close(p1, p0, rtol=2e-4 if dtype == torch.float32 else 1e-12, atol=1e-7)
    assert torch.allclose(p1.sum(-1), torch.ones(2, 29, dtype=dtype))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("chunk", [5, 16, 57])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ttt_loss_chunked_equal(k, chunk, dtype):
    (r0, g0), (r1, g1) = run(dtype, 0, k), run(dtype, chunk, k)
    rtol = 2e-5 if dtype == torch.float32 else 1e-6  # the logits' log-softmax is fp32 in both paths
    assert r1.step_count == r0.step_count and r1.step_correct == r0.step_correct
    assert float(r1.loss.detach()) == pytest.approx(float(r0.loss.detach()), rel=rtol)
    assert r1.step_loss == pytest.approx(r0.step_loss, rel=rtol)
    assert g0.keys() == g1.keys() and "lm_head.weight" in g0 and "fc.weight" in g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=rtol, atol=rtol * float(g0[n].abs().max()), msg=n)


@pytest.mark.parametrize("offset, chunk", [(1, 4), (3, 7), (40, 5)])
def test_chunked_soft_ce_equals_plain(offset, chunk):
    """The autograd function alone: sum, per-position argmax (the top-1 check) and gradient equal
    log_softmax + shifted targets + autograd; positions without a target get no gradient."""
    g = torch.Generator().manual_seed(offset)
    z = (4 * torch.randn(3, 23, VD, generator=g)).requires_grad_()
    probs = torch.softmax(3 * torch.randn(3, 23, VD, generator=g), -1)
    valid = torch.rand(3, 23, generator=g) < 0.7
    valid[:, max(0, 23 - offset - 1):] = False  # (t, k) is never valid where t + 1 + k >= T
    logp = torch.log_softmax(z, -1)
    want = (-(shift(probs, offset, 0.0) * logp).sum(-1) * valid).sum()
    (want * 0.37).backward()
    want_grad, z.grad = z.grad, None
    total, pred = ChunkedSoftCE.apply(z, probs, valid, offset, chunk)
    (total * 0.37).backward()
    assert float(total.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    n = max(0, 23 - offset)
    assert torch.equal(pred[:, :n], logp.argmax(-1)[:, :n]) and not pred[:, n:].any()
    torch.testing.assert_close(z.grad, want_grad, rtol=1e-5, atol=1e-7)
    assert not z.grad[:, n:].any()


def test_ttt_loss_chunked_global_denominators():
    """A rank's share of a global batch (FSDP): the chunked path divides by the given counts too."""
    (r0, g0), (r1, g1) = run(torch.float64, 0, 2, [50, 40]), run(torch.float64, 5, 2, [50, 40])
    assert float(r1.loss.detach()) == pytest.approx(float(r0.loss.detach()), rel=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-6 * float(g0[n].abs().max()), msg=n)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and not func.is_view:  # e.g. the head weight's transpose
                self.shapes.append((str(func), tuple(o.shape)))
        return out


@pytest.mark.parametrize("chunk", [7, 16])
def test_target_targets_never_builds_full_vocab_rows(chunk):
    """Structural bound: no op output over the target vocab spans more than one chunk of positions."""
    _, head, ids = make(torch.float32)
    b = batch(torch.float32)

    def widest(c: int) -> int:
        with _Shapes() as rec:
            target_targets(head, b.last_hidden, ids, chunk_tokens=c)
        full = [s for _, s in rec.shapes if s and s[-1] == V]
        assert full, "the head's logits were not seen"
        return max(int(torch.tensor(s[:-1]).prod()) for s in full)

    assert widest(0) == 2 * 29  # the plain path: all 58 positions at once (the check sees it)
    assert widest(chunk) <= chunk


def _saved_vocab_bytes(chunk: int, k: int) -> tuple[int, int]:
    """(bytes of distinct storages saved for backward with last dim Vd, excluding the target
    distribution and the draft's lm_head weight, which both paths share; size of one [B, T, Vd]
    fp32 tensor)."""
    model, head, ids = make(torch.float32)
    b = batch(torch.float32)
    probs, argmax = target_targets(head, b.last_hidden, ids, chunk_tokens=chunk)
    saved: dict[int, int] = {}
    shared = {probs.untyped_storage().data_ptr(), model.lm_head.weight.untyped_storage().data_ptr()}

    def pack(x: torch.Tensor):
        st = x.untyped_storage()
        if x.dim() and x.shape[-1] == VD and st.data_ptr() not in shared:
            saved[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        res = ttt_loss(model, b, probs, argmax, num_steps=k, step_decay=0.8, chunk_tokens=chunk)
    res.loss.backward()
    return sum(saved.values()), probs.numel() * 4


def test_chunked_loss_saves_one_vocab_tensor_per_step():
    """The plain path keeps the fp32 log-softmax and a shifted copy of the target distribution
    per step; the chunked one keeps only the draft's logits (in their own dtype)."""
    k = 3
    plain, one = _saved_vocab_bytes(0, k)
    chunked, _ = _saved_vocab_bytes(7, k)
    assert plain == 2 * k * one
    assert chunked == k * one


def test_config_knob():
    import yaml

    toy = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml").read_text())["train"]
    cfg = TrainConfig(**toy)
    # The toy recipe's batches (at most batch_rows x pack_tokens positions) take the plain path:
    # its numbers (weights, AL) do not move.
    assert cfg.target_chunk_tokens >= cfg.pack_tokens * cfg.batch_rows
    assert TrainConfig(target_chunk_tokens=0).target_chunk_tokens == 0
    with pytest.raises(ConfigError, match="train.target_chunk_tokens"):
        TrainConfig(target_chunk_tokens=-1)


@pytest.mark.slow
def test_trainer_chunked_matches_plain(tmp_path, feature_store, tiny_target):
    """The trainer passes train.target_chunk_tokens through: chunked and plain runs agree step by step."""
    import json

    from eaglenest.train.loop import train

    kw = dict(draft_vocab_size=512, ttt_steps=3, pack_tokens=96, batch_rows=3, num_steps=6, warmup_steps=2,
              log_every_steps=1, num_threads=1, state=StateConfig(every_steps=0))
    runs = []
    for chunk in (0, 40):  # 40 < 3 rows x up to 96 tokens: every batch is chunked
        train(TrainConfig(**kw, target_chunk_tokens=chunk, output_subdir=f"chunk{chunk}"), store_uri=feature_store[0],
              workdir=str(tmp_path), target_dir=str(tiny_target), seed=0)
        runs.append([json.loads(x) for x in (tmp_path / f"chunk{chunk}" / "metrics.jsonl").read_text().splitlines()])
    plain, chunked = runs
    assert len(plain) == len(chunked) == 6
    for a, b in zip(plain, chunked):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["step_count"] == a["step_count"] and b["tokens"] == a["tokens"]
        assert b["step_acc"] == pytest.approx(a["step_acc"], abs=0.02)
