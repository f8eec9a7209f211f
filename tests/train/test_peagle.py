"""P-EAGLE (train.family=peagle): the one-forward objective is what vLLM's parallel drafter computes.

The slot mask is checked entry by entry; each slot's output in the one forward is checked against
the plain causal run vLLM's drafter does for that request (depth-0 inputs up to the anchor, then
the mask slots), and the loss against soft cross-entropy over those outputs at the target's
distribution for x_{a+2+d}. Then the trainer end to end on the synthetic store.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.config import apply_overrides, build
from eaglenest.errors import ConfigError
from eaglenest.train import peagle as P
from eaglenest.train.checkpoint import load_checkpoint
from eaglenest.train.config import PEagleConfig, TrainConfig
from eaglenest.train.loop import train
from eaglenest.train.model import DraftFlags, Eagle3Draft, causal_doc_mask, draft_config, init_weights
from eaglenest.train.ttt import step_valid, target_targets

MASK_ID = 5

# test_ttt's draft and batch builders (tests are not packages: loaded by path).
_spec = importlib.util.spec_from_file_location("_eaglenest_test_ttt_peagle", Path(__file__).with_name("test_ttt.py"))
_ttt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ttt)
H, TARGET_CFG, V, make_model, make_rows, to_batch = (_ttt.H, _ttt.TARGET_CFG, _ttt.V, _ttt.make_model,
                                                    _ttt.make_rows, _ttt.to_batch)


def peagle_model(seed: int, *, window: int = 0, flags: DraftFlags = DraftFlags()):
    """test_ttt's double-precision draft, rebuilt as a P-EAGLE draft (mask_hidden, mask token id)."""
    base, head, ids = make_model(seed, flags)
    cfg = draft_config(TARGET_CFG, draft_vocab_size=base.config.draft_vocab_size, layer_ids=(1, 2, 3),
                       flags=flags, sliding_window=window)
    P.configure(cfg, PEagleConfig(mask_token_id=MASK_ID), TARGET_CFG)
    model = Eagle3Draft(cfg).double()
    init_weights(model, seed=seed, std=0.3)
    model.load_state_dict(base.state_dict(), strict=False)  # everything but mask_hidden
    assert model.mask_hidden.shape == (3 * H,) and model.mask_hidden.abs().sum() > 0
    return model, head, ids


def with_anchors(batch, anchors: list[list[int]], ok: list[list[bool]] | None = None) -> P.PEagleBatch:
    a = torch.tensor(anchors)
    return P.PEagleBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(_ttt.Batch)}, anchors=a,
                         anchor_ok=torch.tensor(ok) if ok is not None else torch.ones_like(a, dtype=torch.bool))


def test_slot_mask_entries():
    """Row of two packed documents (positions 0-4 and 5-10); anchors 1 (doc 0) and 7 (doc 1); 3 slots
    (depth 0 + two mask slots per anchor): slots 0,1 = anchor 1 depths 1,2; slots 2,3 = anchor 7."""
    batch = with_anchors(to_batch(make_rows(0, [[5, 6]])), [[1, 7]])
    m = P.slot_mask(batch, 3)[0]
    T, S = 11, 4
    assert m.shape == (T + S, T + S)
    assert torch.equal(m[:T, :T], causal_doc_mask(batch.doc_ids)[0])
    assert not m[:T, T:].any()  # depth-0 positions never see a slot
    seen = {i: [j for j in range(T + S) if m[T + i, j]] for i in range(S)}
    assert seen[0] == [0, 1, T]                       # anchor 1, depth 1: context 0..1, itself
    assert seen[1] == [0, 1, T, T + 1]                # depth 2: also depth 1 of its chain
    assert seen[2] == [5, 6, 7, T + 2]                # anchor 7: its document only (5..7)
    assert seen[3] == [5, 6, 7, T + 2, T + 3]
    _, anchor, pos = P.slot_layout(batch, 3)
    assert anchor.tolist() == [[1, 1, 7, 7]] and pos.tolist() == [[2, 3, 3, 4]]  # pos(a) + d
    # A sliding window of 3 positions: slot at position pos(a)+d sees context positions > pos - 3.
    w = P.slot_mask(batch, 3, window=3)[0]
    assert [j for j in range(T) if w[T + 1, j]] == [1]            # position 3 sees position 1 only
    assert [j for j in range(T) if w[T + 3, j]] == [7]            # position 4 (doc 1) sees 2 only
    # A padding anchor sees no context, only its own chain (its loss is masked).
    pad = P.slot_mask(with_anchors(batch, [[1, 0]], [[True, False]]), 3)[0]
    assert [j for j in range(T + S) if pad[T + 3, j]] == [T + 2, T + 3]


def _vllm_round(model, batch, r: int, a: int, d: int) -> torch.Tensor:
    """What vLLM's parallel drafter computes for slot d of anchor a: one plain causal pass over the
    request's depth-0 inputs (token x_{p+1}, hidden fc(aux_p), position p; p from the document's start
    to a), then mask slots 1..d (mask token, fc(mask_hidden), positions pos(a)+1..); the last output."""
    doc = batch.doc_ids[r]
    start = int((doc == doc[a]).nonzero().min())
    ctx = torch.arange(start, a + 1)
    tokens = torch.cat([batch.input_ids[r, ctx + 1], torch.full((d,), MASK_ID)])
    hidden = torch.cat([model.combine(batch.aux[r, ctx]), model.combine(model.mask_hidden).expand(d, -1)])
    pos = torch.cat([batch.position_ids[r, ctx], batch.position_ids[r, a] + torch.arange(1, d + 1)])
    n = len(tokens)
    mask = torch.ones(1, n, n, dtype=torch.bool).tril()
    window = int(getattr(model.config, "sliding_window", 0) or 0)
    if window:
        mask &= (pos[:, None] - pos[None, :] < window)[None]
    normed, _ = model.step(tokens[None], hidden[None], pos[None], [], mask)
    return normed[0, -1]


@pytest.mark.parametrize("window", [0, 4])
def test_one_forward_equals_vllms_parallel_round_and_loss(window):
    model, head, ids = peagle_model(1, window=window)
    batch = P.sample_anchors(to_batch(make_rows(2, [[9, 8], [13], [4]], p_loss=0.9)), num_anchors=3, seed=0, step=0)
    K = 4
    normed = P.peagle_forward(model, batch, K)
    T = batch.input_ids.shape[1]
    probs, argmax = target_targets(head, batch.last_hidden, ids)
    res = P.peagle_loss(model, batch, probs, argmax, num_slots=K, step_decay=0.8)
    # Depth 0 is EAGLE-3's first step at every position (causal, no slot visible).
    ref0, _ = model.step(torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1] * 0], 1),
                         model.combine(batch.aux), batch.position_ids, [],
                         causal_doc_mask(batch.doc_ids, window=window))
    torch.testing.assert_close(normed[:, :T], ref0)
    ce = {d: [] for d in range(1, K)}
    for r in range(batch.input_ids.shape[0]):
        for i, (a, ok) in enumerate(zip(batch.anchors[r].tolist(), batch.anchor_ok[r].tolist())):
            if not ok:
                continue
            for d in range(1, K):
                out = normed[r, T + i * (K - 1) + d - 1]
                torch.testing.assert_close(out, _vllm_round(model, batch, r, a, d))
                if step_valid(batch, d)[r, a]:  # slot d predicts x_{a+2+d}: the target's distribution at a+1+d
                    logp = torch.log_softmax(model.logits(out), -1)
                    ce[d].append(-(probs[r, a + 1 + d] * logp).sum())
    assert batch.anchor_ok.sum() >= 5 and all(ce[d] for d in range(1, K))  # every depth compared below
    assert res.step_count[1:] == [len(ce[d]) for d in range(1, K)]
    assert res.step_count[0] == int(step_valid(batch, 0).sum())
    for d in range(1, K):
        if ce[d]:
            # (the loss takes log-softmax in fp32, as TTT does)
            assert res.step_loss[d] == pytest.approx(float(torch.stack(ce[d]).mean().detach()), rel=1e-6)
    assert torch.isfinite(res.loss)
    res.loss.backward()
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0


def test_anchors_are_a_pure_function_of_seed_step_and_row():
    rows = make_rows(3, [[20], [7, 9], [16]], p_loss=0.8)
    batch = to_batch(rows)
    a = P.sample_anchors(batch, num_anchors=4, seed=0, step=5)
    cand = step_valid(batch, 1)
    for r in range(3):
        picked = a.anchors[r][a.anchor_ok[r]]
        assert len(picked) == min(4, int(cand[r].sum())) and cand[r, picked].all()
        assert picked.tolist() == sorted(set(picked.tolist()))
    # The same row elsewhere in another batch (another rank's share) gets the same anchors.
    alone = P.sample_anchors(to_batch([rows[2]]), num_anchors=4, seed=0, step=5)
    assert torch.equal(alone.anchors[0], a.anchors[2])
    assert torch.equal(P.sample_anchors(batch, num_anchors=4, seed=0, step=5).anchors, a.anchors)
    assert not torch.equal(P.sample_anchors(batch, num_anchors=4, seed=0, step=6).anchors, a.anchors)


def test_config_family_and_refusals():
    assert TrainConfig().family == "eagle3"
    assert TrainConfig(family="dflash").family == "dflash"  # tests/train/test_dflash.py
    with pytest.raises(ConfigError, match="train.family"):
        TrainConfig(family="medusa")
    with pytest.raises(ConfigError, match="train.peagle.num_slots"):
        PEagleConfig(num_slots=1)
    with pytest.raises(ConfigError, match="pack_tokens"):
        TrainConfig(family="peagle", pack_tokens=4096, attn_chunk_tokens=2048)
    assert P.mask_token_id(PEagleConfig(), {**TARGET_CFG, "pad_token_id": 0}) == 0
    assert P.mask_token_id(PEagleConfig(), {**TARGET_CFG, "eos_token_id": [7, 9]}) == 7
    with pytest.raises(ConfigError, match="train.peagle.mask_token_id"):
        P.mask_token_id(PEagleConfig(mask_token_id=V), TARGET_CFG)


FAST = dict(draft_vocab_size=512, pack_tokens=128, batch_rows=2, warmup_steps=5, log_every_steps=5, lr=5e-3,
            family="peagle", peagle=PEagleConfig(num_slots=3, anchors_per_row=16))


@pytest.mark.slow
def test_trainer_reduces_the_peagle_loss_and_exports_its_draft(tmp_path, feature_store, tiny_target):
    uri, _ = feature_store
    s = train(TrainConfig(**FAST, num_epochs=6), store_uri=uri, workdir=str(tmp_path / "w"),
              target_dir=str(tiny_target), seed=0, argv=["test"])
    lines = [json.loads(x) for x in (s.outdir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 4 and all(len(x["step_loss"]) == 3 for x in lines)
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])
    assert lines[-1]["step_acc"][1] > lines[0]["step_acc"][1]
    assert lines[-1]["step_count"][1] <= 16 * 2 * 5  # anchors x rows x steps of the window
    saved = load_file(s.outdir / "draft.safetensors")
    assert saved["mask_hidden"].shape == (3 * 128,)
    model, info = load_checkpoint(s.outdir, target_dir=tiny_target)
    assert info["draft_config"]["parallel_drafting"] is True and info["draft_config"]["mask_token_id"] == 0
    assert torch.equal(model.mask_hidden.detach(), saved["mask_hidden"])


@pytest.mark.slow
def test_two_ranks_match_one_rank(tmp_path, feature_store, tiny_target):
    """FSDP2 over 2 gloo ranks trains the same P-EAGLE trajectory as 1 rank: the anchors are drawn per
    row (not per rank) and the per-depth denominators are global."""
    traj = dict(draft_vocab_size=512, pack_tokens=96, batch_rows=3, warmup_steps=5, lr=2e-3, num_epochs=7,
                num_steps=8, log_every_steps=1, num_threads=1, sliding_window="auto", family="peagle",
                **{"peagle.num_slots": 3, "peagle.anchors_per_row": 8})
    cfg = build(TrainConfig, apply_overrides({}, [f"{k}={v}" for k, v in traj.items()]), where="train")
    train(cfg, store_uri=feature_store[0], workdir=str(tmp_path / "one"), target_dir=str(tiny_target), seed=0)
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "2", "--recipe", recipe,
           f"run.workdir={tmp_path / 'two'}", f"run.target={tiny_target}", f"run.store={feature_store[0]}",
           *(f"train.{k}={v}" for k, v in traj.items())]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-12000:]
    a, b = ([json.loads(x) for x in (tmp_path / w / "train" / "metrics.jsonl").read_text().splitlines()]
            for w in ("one", "two"))
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert y["step_count"] == x["step_count"] and len(x["step_count"]) == 3
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6), (x["step"], x["loss"], y["loss"])
