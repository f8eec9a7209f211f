"""DFlash (train.family=dflash): the one-forward block objective is what vLLM's DFlash drafter computes.

The block mask is checked entry by entry; each block's outputs in the one forward are checked
against an independent plain computation of vLLM's DFlash round for that request (written here
from the weights with plain tensor ops: context keys from hidden_norm(fc(aux)) through each layer's
k_proj/k_norm/rotary, the block through Qwen3 layers attending to [context ; whole block]), and the
loss against soft cross-entropy at the target's distribution for x_{p+k}. Then the trainer end to
end on the synthetic store: the loss falls, the checkpoint reloads as a DFlash draft.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from eaglenest.errors import ConfigError, SchemaError
from eaglenest.train import dflash as D
from eaglenest.train.checkpoint import load_checkpoint
from eaglenest.train.config import DFlashConfig, TrainConfig
from eaglenest.train.loop import train
from eaglenest.train.model import DraftFlags, draft_config, init_weights
from eaglenest.train.ttt import target_targets

MASK_ID = 5

_spec = importlib.util.spec_from_file_location("_eaglenest_test_ttt_dflash", Path(__file__).with_name("test_ttt.py"))
_ttt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ttt)
H, TARGET_CFG, V, VD, make_model, make_rows, to_batch = (_ttt.H, _ttt.TARGET_CFG, _ttt.V, _ttt.VD, _ttt.make_model,
                                                         _ttt.make_rows, _ttt.to_batch)


def dflash_model(seed: int, *, layers: int = 2, block_size: int = 4):
    """A double-precision DFlash draft with random non-trivial weights (norms included)."""
    g = torch.Generator().manual_seed(seed)
    _, head, ids = make_model(seed)
    cfg = draft_config(TARGET_CFG, draft_vocab_size=VD, layer_ids=(1, 2, 3), flags=DraftFlags())
    D.configure(cfg, DFlashConfig(num_layers=layers, block_size=block_size, mask_token_id=MASK_ID), TARGET_CFG)
    model = D.DFlashDraft(cfg).double()
    init_weights(model, seed=seed, std=0.3)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
        model.d2t.copy_(ids - torch.arange(VD))
    return model, head, ids


def with_anchors(batch, anchors, ok=None) -> D.DFlashBatch:
    import dataclasses

    a = torch.tensor(anchors)
    return D.DFlashBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(_ttt.Batch)}, anchors=a,
                         anchor_ok=torch.tensor(ok) if ok is not None else torch.ones_like(a, dtype=torch.bool))


def test_block_mask_entries():
    """Row of two packed documents (positions 0-4 and 5-10); anchors 2 (doc 0) and 8 (doc 1); block 3."""
    batch = with_anchors(to_batch(make_rows(0, [[5, 6]])), [[2, 8]])
    m = D.block_mask(batch, 3)[0]
    T, S = 11, 6
    assert m.shape == (S, T + S)
    seen = {i: [j for j in range(T + S) if m[i, j]] for i in range(S)}
    for k in range(3):  # anchor 2: context 0..1 (before the anchor), the whole block, non-causal
        assert seen[k] == [0, 1, T, T + 1, T + 2]
    for k in range(3, 6):  # anchor 8: its document's context 5..7 only, its own block
        assert seen[k] == [5, 6, 7, T + 3, T + 4, T + 5]
    causal = D.block_mask(batch, 3, causal=True)[0]  # what a block-causal export would serve
    assert [j for j in range(T + S) if causal[0, j]] == [0, 1, T]
    assert [j for j in range(T + S) if causal[5, j]] == [5, 6, 7, T + 3, T + 4, T + 5]
    pad = D.block_mask(with_anchors(batch, [[2, 0]], [[True, False]]), 3)[0]
    assert [j for j in range(T + S) if pad[4, j]] == [T + 3, T + 4, T + 5]  # padding: its block only
    tokens, pos = D.block_inputs(batch, 3, MASK_ID)
    ids = batch.input_ids[0]
    assert tokens[0].tolist() == [int(ids[2]), MASK_ID, MASK_ID, int(ids[8]), MASK_ID, MASK_ID]
    assert pos[0].tolist() == [2, 3, 4, 3, 4, 5]  # pos(p) + k, positions restart per document


def _rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    """Neox-style rotary over the last dim of x [n, heads, d] at positions pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _vllm_round(model, batch, r: int, p: int, bs: int) -> torch.Tensor:
    """vLLM's DFlash round for the request whose bonus token sits at p: context positions from the
    document's start to p-1 (their keys/values written to the cache from the target's features),
    then one forward of the block [x_p, mask x (bs-1)] at pos(p).. attending to cache + block.
    Returns the normed outputs [bs, H]. Plain ops from the state dict, no module forward."""
    w = {k: v for k, v in model.state_dict().items()}
    c = model.config
    nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    doc = batch.doc_ids[r]
    start = int((doc == doc[p]).nonzero().min())
    ctx_pos = batch.position_ids[r, start:p]
    ctx = _rms(batch.aux[r, start:p] @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = w["embed_tokens.weight"][torch.tensor([int(batch.input_ids[r, p])] + [MASK_ID] * (bs - 1))]
    qpos = batch.position_ids[r, p] + torch.arange(bs)
    for i in range(c.num_hidden_layers):
        L = f"layers.{i}."
        kn, qn = w[L + "self_attn.k_norm.weight"], w[L + "self_attn.q_norm.weight"]

        def kv(h):
            k = _rms((h @ w[L + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), kn)
            return k, (h @ w[L + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)

        kc, vc = kv(ctx)
        kc = _rope(kc, ctx_pos)
        hn = _rms(x, w[L + "input_layernorm.weight"])
        q = _rope(_rms((hn @ w[L + "self_attn.q_proj.weight"].T).view(-1, nh, hd), qn), qpos)
        kb, vb = kv(hn)
        kb = _rope(kb, qpos)
        k = torch.cat([kc, kb]).repeat_interleave(nh // nkv, dim=1)
        v = torch.cat([vc, vb]).repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)  # no mask: all of it
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * hd) @ w[L + "self_attn.o_proj.weight"].T
        m = _rms(x, w[L + "post_attention_layernorm.weight"])
        gate, up = m @ w[L + "mlp.gate_proj.weight"].T, m @ w[L + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[L + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"])


@pytest.mark.parametrize("layers,bs", [(1, 3), (2, 4)])
def test_one_forward_equals_vllms_round_and_loss(layers, bs):
    model, head, ids = dflash_model(3, layers=layers, block_size=bs)
    batch = D.sample_anchors(to_batch(make_rows(2, [[9, 8], [13], [4]], p_loss=0.9)), num_anchors=3, seed=0, step=0)
    a = batch.anchors.shape[1]
    normed = D.dflash_forward(model, batch, bs).view(3, a, bs, -1)
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = D.dflash_loss(model, batch, probs, argmax, block_size=bs, step_decay=0.8)
    ce = {k: [] for k in range(1, bs)}
    for r in range(3):
        for i, (p, ok) in enumerate(zip(batch.anchors[r].tolist(), batch.anchor_ok[r].tolist())):
            if not ok:
                continue
            ref = _vllm_round(model, batch, r, p, bs)
            # (tolerance: the rotary tables are float32, as in vLLM and HF; a wrong mask/offset is O(1))
            torch.testing.assert_close(normed[r, i], ref, rtol=1e-5, atol=1e-5)
            for k in range(1, bs):
                if D.slot_valid(batch, k)[r, p]:  # slot k proposes x_{p+k}: the target's distribution at p+k-1
                    logp = torch.log_softmax(model.logits(normed[r, i, k]), -1)
                    ce[k].append(-(probs[r, p + k - 1] * logp).sum())
    assert batch.anchor_ok.sum() >= 6 and all(ce[k] for k in range(1, bs))  # every slot compared below
    # What the comparison catches: the same weights with block-causal attention (a mis-flagged export).
    tokens, pos = D.block_inputs(batch, bs, MASK_ID)
    causal = model(tokens, pos, model.context(batch.aux), batch.position_ids,
                   D.block_mask(batch, bs, causal=True)).view(3, a, bs, -1)
    assert (causal[:, :, 1:-1] - normed[:, :, 1:-1]).abs().max() > 1e-2
    assert res.step_count == [len(ce[k]) for k in range(1, bs)]
    for k in range(1, bs):
        if ce[k]:
            assert res.step_loss[k - 1] == pytest.approx(float(torch.stack(ce[k]).mean().detach()), rel=1e-6)
    expected = sum(0.8 ** (k - 1) * torch.stack(ce[k]).mean() for k in range(1, bs) if ce[k])
    assert float(res.loss) == pytest.approx(float(expected), rel=1e-6)
    res.loss.backward()
    # One k_norm for all layers (what vLLM-CPU applies to every layer's context keys), one parameter.
    assert all(l.self_attn.k_norm is model.layers[0].self_attn.k_norm for l in model.layers)
    assert sum(n.endswith("k_norm.weight") for n, _ in model.named_parameters()) == 1
    assert sum(n.endswith("k_norm.weight") for n in model.state_dict()) == layers
    assert model.fc.weight.grad.abs().sum() > 0 and model.layers[0].self_attn.k_norm.weight.grad.abs().sum() > 0


def test_anchors_have_context_and_a_first_slot():
    rows = make_rows(4, [[20], [7, 9], [16]], p_loss=0.8)
    batch = to_batch(rows)
    a = D.sample_anchors(batch, num_anchors=4, seed=0, step=5)
    cand = D.anchor_candidates(batch)
    for r in range(3):
        assert int(a.anchor_ok[r].sum()) == min(4, int(cand[r].sum())) > 0  # every row drew, up to 4
        for p in a.anchors[r][a.anchor_ok[r]].tolist():
            assert p >= 1 and batch.doc_ids[r, p - 1] == batch.doc_ids[r, p]  # at least one context position
            assert batch.loss_mask[r, p + 1] and batch.doc_ids[r, p + 1] == batch.doc_ids[r, p]
    alone = D.sample_anchors(to_batch([rows[2]]), num_anchors=4, seed=0, step=5)
    assert torch.equal(alone.anchors[0], a.anchors[2])  # per row, not per batch (rank count, resume)
    assert not torch.equal(D.sample_anchors(batch, num_anchors=4, seed=0, step=6).anchors, a.anchors)


def test_config_and_refusals():
    cfg = TrainConfig(family="dflash")
    assert cfg.dflash == DFlashConfig() and (cfg.dflash.num_layers, cfg.dflash.block_size) == (2, 8)
    with pytest.raises(ConfigError, match="train.dflash.block_size"):
        DFlashConfig(block_size=1)
    with pytest.raises(ConfigError, match="train.dflash.num_layers"):
        DFlashConfig(num_layers=0)
    with pytest.raises(ConfigError, match="train.sliding_window"):
        TrainConfig(family="dflash", sliding_window=64)
    assert TrainConfig(family="dflash", sliding_window="auto").sliding_window == "auto"  # the demo's: no window
    assert D.mask_token_id(DFlashConfig(), {**TARGET_CFG, "pad_token_id": 0}) == 0
    with pytest.raises(ConfigError, match="train.dflash.mask_token_id"):
        D.mask_token_id(DFlashConfig(mask_token_id=V), TARGET_CFG)
    # A table whose aux layers include the embeddings (vLLM id 0) cannot feed DFlash: named, with the capture.
    with pytest.raises(SchemaError, match=r"aux layers \[0, 2, 3\].*featurestore capture featurestore.layer_ids=\[2, 3\]"):
        D.check_layers((0, 2, 3))
    D.check_layers((1, 2, 3))


FAST = dict(draft_vocab_size=512, pack_tokens=128, batch_rows=2, warmup_steps=5, log_every_steps=5, lr=5e-3,
            family="dflash", dflash=DFlashConfig(num_layers=1, block_size=3, anchors_per_row=16))


@pytest.mark.slow
def test_trainer_reduces_the_dflash_loss_and_saves_its_draft(tmp_path, feature_store, tiny_target):
    uri, _ = feature_store
    s = train(TrainConfig(**FAST, num_epochs=6), store_uri=uri, workdir=str(tmp_path / "w"),
              target_dir=str(tiny_target), seed=0, argv=["test"])
    lines = [json.loads(x) for x in (s.outdir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 4 and all(len(x["step_loss"]) == 2 for x in lines)  # slots 1 and 2
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])
    assert lines[-1]["step_acc"][0] > lines[0]["step_acc"][0]
    assert lines[-1]["step_count"][0] <= 16 * 2 * 5  # anchors x rows x steps of the window
    model, info = load_checkpoint(s.outdir, target_dir=tiny_target)
    assert isinstance(model, D.DFlashDraft) and info["draft_config"]["dflash"] is True
    assert info["draft_config"]["num_hidden_layers"] == 1 and info["draft_config"]["dflash_block_size"] == 3
