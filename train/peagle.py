"""P-EAGLE (``train.family=peagle``): an EAGLE-3 draft that drafts every token of a round in ONE forward.

What vLLM 0.32 serves (``speculative_config`` ``{"method": "eagle3", "parallel_drafting": true}``,
read in ``v1/spec_decode/llm_base_proposer.py`` and ``v1/spec_decode/utils.py``
``copy_and_expand_eagle_inputs_kernel``): after a verification, the drafter's one forward holds, per
request, the EAGLE-3 depth-0 inputs of the newly verified positions (token x_{p+1}, hidden
fc(aux_p), position p), the last of which (the bonus token at the anchor a) predicts x_{a+2}, then
``num_speculative_tokens - 1`` mask slots: token ``mask_token_id``, hidden
``combine_hidden_states(mask_hidden)`` (the draft's own fc over the learned [n_aux*H] vector),
positions pos(a)+1, pos(a)+2, ... Attention is causal over the draft's KV cache, which holds
depth-0 keys at every earlier position. So, in training terms (same indexing as
:mod:`eaglenest.train.ttt`):

* depth 0 at position t: EAGLE-3's step 0 (token x_{t+1}, hidden fc(aux_t), position pos(t));
  predicts x_{t+2}; attends causally to depth-0 keys of its document. Trained at every position.
* depth d >= 1 of anchor a: token ``mask_token_id``, hidden fc(mask_hidden), position pos(a)+d;
  predicts x_{a+2+d}; attends to depth-0 keys s <= a of a's document and to its own chain's
  slots 1..d. Trained at ``train.peagle.anchors_per_row`` anchors drawn per row and step.

No slot reads another slot's output, so the whole round is one pass of the draft's single layer
over the concatenation [depth-0 positions ; anchor slots] with the explicit mask of
:func:`slot_mask` (vs. K sequential passes in TTT). Loss: soft cross-entropy against the target's
distribution, as TTT, with weight ``train.step_decay ** d`` for depth d, each depth averaged over
its valid predictions (denominators global across ranks). The trade-off: a dense
[T+S, T+S] mask per row (S = anchors x (num_slots-1)), hence ``pack_tokens <= attn_chunk_tokens``
(checked in the config).

Anchor choice is a pure function of (seed, step, row tokens), so it does not depend on the rank
count or on a resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from eaglenest.errors import ConfigError
from eaglenest.train.config import PEagleConfig
from eaglenest.train.model import Eagle3Draft, attention_window, causal_doc_mask
from eaglenest.train.ttt import Batch, ChunkedSoftCE, TTTObjective, TTTResult, shift, step_valid


def resolve_mask_token(chosen: int | None, target_cfg: dict[str, Any], key: str) -> int:
    """The mask token id named by recipe key ``key`` (``chosen``), or else the first of the target's
    pad_token_id and eos_token_id(s) that is a token id of its vocabulary; refused when outside it."""
    vocab = int(target_cfg["vocab_size"])
    if chosen is None:
        found = default_token_ids(target_cfg)
        tid = next((i for i in found if 0 <= i < vocab), None)
        if tid is None:
            named = ", ".join(f"{name} {target_cfg.get(name)!r}" for name in ("pad_token_id", "eos_token_id"))
            raise ConfigError(f"{key}: null, and the target's config names no token id of its vocabulary "
                              f"(size {vocab}) to use ({named}); set a token id of its vocabulary")
        return tid
    if not 0 <= int(chosen) < vocab:
        raise ConfigError(f"{key}: {chosen} is outside the target's vocabulary (size {vocab})")
    return int(chosen)


def default_token_ids(target_cfg: dict[str, Any]) -> list[int]:
    """The target's pad_token_id, then its eos_token_id(s) (an int or a list), integers only."""
    ids = []
    for name in ("pad_token_id", "eos_token_id"):
        value = target_cfg.get(name)
        for tid in value if isinstance(value, list) else [value]:
            if isinstance(tid, int) and not isinstance(tid, bool):
                ids.append(tid)
    return ids


def mask_token_id(cfg: PEagleConfig, target_cfg: dict[str, Any]) -> int:
    """``train.peagle.mask_token_id``, or the first of the target's pad/eos token ids in its vocabulary."""
    return resolve_mask_token(cfg.mask_token_id, target_cfg, "train.peagle.mask_token_id")


def configure(draft_cfg, cfg: PEagleConfig, target_cfg: dict[str, Any]) -> None:
    """Mark a draft config (before the draft is built) as P-EAGLE: it then gets ``mask_hidden``."""
    draft_cfg.parallel_drafting = True
    draft_cfg.mask_token_id = mask_token_id(cfg, target_cfg)
    draft_cfg.peagle_num_slots = int(cfg.num_slots)


@dataclasses.dataclass
class PEagleBatch(Batch):
    """A batch with its anchors: ``anchors`` long [B, A] (positions), ``anchor_ok`` bool [B, A]
    (False: padding, the row had fewer candidates)."""

    anchors: torch.Tensor = None
    anchor_ok: torch.Tensor = None


def _row_seed(seed: int, step: int, ids: torch.Tensor, salt: tuple[int, ...] = ()) -> int:
    # Python's hash of a tuple of ints does not depend on PYTHONHASHSEED (only str/bytes do): the
    # salt that tells two families' draws apart is an int for that reason.
    return hash((*salt, int(seed), int(step), tuple(ids.tolist()))) & 0x7FFF_FFFF_FFFF_FFFF


def draw_anchors(cand: torch.Tensor, batch: Batch, *, num_anchors: int, seed: int, step: int,
                 salt: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Up to ``num_anchors`` of each row's candidate positions (``cand`` bool [B, T]), without
    replacement, ascending; the draw depends on (salt, seed, step, the row's tokens) only, so a row
    draws alike on any number of ranks and across a resume. The batch's fields plus ``anchors``
    long [B, A] and ``anchor_ok`` bool [B, A] (False: padding, the row had fewer candidates), with
    A = ``num_anchors`` but at most the row length T (a row has no more candidates than positions,
    and the slots' mask grows with A squared)."""
    cand = cand.cpu()
    rows = cand.shape[0]
    num_anchors = min(int(num_anchors), cand.shape[1])
    anchors = torch.zeros(rows, num_anchors, dtype=torch.long)
    ok = torch.zeros(rows, num_anchors, dtype=torch.bool)
    ids, docs = batch.input_ids.cpu(), batch.doc_ids.cpu()
    for b in range(rows):
        idx = cand[b].nonzero().flatten()
        if not len(idx):
            continue
        # The row's tokens without padding: a row padded to another batch width (another rank) draws alike.
        g = torch.Generator().manual_seed(_row_seed(seed, step, ids[b][docs[b] >= 0], salt))
        pick = idx[torch.randperm(len(idx), generator=g)[:num_anchors]].sort().values
        anchors[b, :len(pick)] = pick
        ok[b, :len(pick)] = True
    dev = batch.input_ids.device
    return {**{f.name: getattr(batch, f.name) for f in dataclasses.fields(Batch)},
            "anchors": anchors.to(dev), "anchor_ok": ok.to(dev)}


def sample_anchors(batch: Batch, *, num_anchors: int, seed: int, step: int) -> PEagleBatch:
    """Up to ``num_anchors`` anchors per row, uniformly among positions whose depth-1 slot has a
    valid target (a loss token of the same document), without replacement, in ascending order."""
    return PEagleBatch(**draw_anchors(step_valid(batch, 1), batch, num_anchors=num_anchors, seed=seed, step=step))


def slot_layout(batch: PEagleBatch, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(depth [S], anchor position [B, S], position id [B, S]) of the S = A*(num_slots-1) mask slots,
    anchor-major: slot j is depth 1 + j % (num_slots-1) of anchor j // (num_slots-1)."""
    per = num_slots - 1
    a = batch.anchors.shape[1]
    depth = torch.arange(1, num_slots, device=batch.anchors.device).repeat(a)
    anchor = batch.anchors.repeat_interleave(per, dim=1)
    return depth, anchor, batch.position_ids.gather(1, anchor) + depth


def slot_mask(batch: PEagleBatch, num_slots: int, *, window: int = 0) -> torch.Tensor:
    """bool [B, T+S, T+S]: query i may see key j, over [depth-0 positions ; mask slots].

    Depth-0 rows: :func:`causal_doc_mask` (slots invisible). Slot (a, d) rows: depth-0 keys s <= a
    in a's document (within ``window`` positions of pos(a)+d when > 0, vLLM's sliding window), and
    the slots (a, d') with d' <= d. A padding anchor sees no context, only its chain (its loss is masked)."""
    doc, pos = batch.doc_ids, batch.position_ids
    rows, t = doc.shape
    depth, anchor, slot_pos = slot_layout(batch, num_slots)
    s = anchor.shape[1]
    per = num_slots - 1
    keys = torch.arange(t, device=doc.device)
    ctx = (keys[None, None, :] <= anchor[:, :, None]) & (doc[:, None, :] == doc.gather(1, anchor)[:, :, None])
    if window > 0:
        ctx &= (slot_pos[:, :, None] - pos[:, None, :]) < window
    ctx &= batch.anchor_ok.repeat_interleave(per, dim=1)[:, :, None]
    chain = torch.arange(s, device=doc.device) // per
    own = (chain[:, None] == chain[None, :]) & (depth[None, :] <= depth[:, None])
    top = torch.cat([causal_doc_mask(doc, window=window), doc.new_zeros(rows, t, s, dtype=torch.bool)], dim=-1)
    bottom = torch.cat([ctx, own.expand(rows, s, s)], dim=-1)
    return torch.cat([top, bottom], dim=1)


def slot_valid(batch: PEagleBatch, d: int) -> torch.Tensor:
    """bool [B, A]: depth d of each anchor predicts a loss token of the anchor's document."""
    return step_valid(batch, d).gather(1, batch.anchors) & batch.anchor_ok


def slot_counts(batch: PEagleBatch, num_slots: int) -> list[int]:
    """Valid predictions per depth: every position at depth 0, the anchors' slots at depth d."""
    return [int(step_valid(batch, 0).sum())] + [int(slot_valid(batch, d).sum()) for d in range(1, num_slots)]


def peagle_forward(model: Eagle3Draft, batch: PEagleBatch, num_slots: int) -> torch.Tensor:
    """The draft's one forward over [depth-0 positions ; slots]: normed output [B, T+S, H]."""
    if model.mask_hidden is None:
        raise ConfigError("train.family=peagle: the draft has no mask_hidden (not built as a P-EAGLE draft)")
    dtype = model.fc.weight.dtype
    rows, t = batch.input_ids.shape
    _depth, _anchor, slot_pos = slot_layout(batch, num_slots)
    s = slot_pos.shape[1]
    hidden = torch.cat([model.combine(batch.aux.to(dtype)),
                        model.combine(model.mask_hidden.to(dtype)).expand(rows, s, -1)], dim=1)
    tokens = torch.cat([shift(batch.input_ids, 1, 0),
                        batch.input_ids.new_full((rows, s), int(model.config.mask_token_id))], dim=1)
    positions = torch.cat([batch.position_ids, slot_pos], dim=1)
    mask = slot_mask(batch, num_slots, window=attention_window(model.config))
    normed, _ = model.step(tokens, hidden, positions, [], mask)
    return normed


@torch.no_grad()
def propose(model: Eagle3Draft, seq: list[int], feats: torch.Tensor, k: int) -> list[int]:
    """vLLM's parallel-drafting round for one request, as the offline estimator replays it: the
    verified tokens ``seq`` (``feats`` [len(seq)-1, H]: fc(aux) of seq[:-1], positions 0..), ONE
    forward over the depth-0 inputs (token seq[i+1], hidden feats[i], position i) and k-1 mask slots
    (``mask_token_id``, fc(mask_hidden), positions after the last), with the trainer's own
    :func:`slot_mask` for the single anchor at the last position; returns the k greedy proposals
    (target ids): the anchor's, then each slot's."""
    t = feats.shape[0]
    assert t == len(seq) - 1 and t >= 1, (t, len(seq))
    if model.mask_hidden is None:
        raise ConfigError("train.family=peagle: the draft has no mask_hidden (not built as a P-EAGLE draft)")
    one = torch.zeros(1, t, dtype=torch.long)
    batch = PEagleBatch(input_ids=torch.tensor([seq[:-1]]), loss_mask=one.bool(), doc_ids=one,
                        position_ids=torch.arange(t)[None], aux=None, last_hidden=None,
                        anchors=torch.tensor([[t - 1]]), anchor_ok=torch.ones(1, 1, dtype=torch.bool))
    _depth, _anchor, slot_pos = slot_layout(batch, k)
    mask_h = model.combine(model.mask_hidden.to(feats.dtype))
    hidden = torch.cat([feats, mask_h.expand(k - 1, -1)])[None]
    tokens = torch.tensor([seq[1:] + [int(model.config.mask_token_id)] * (k - 1)])
    positions = torch.cat([batch.position_ids, slot_pos], dim=1)
    mask = slot_mask(batch, k, window=attention_window(model.config))
    normed, _ = model.step(tokens, hidden, positions, [], mask)
    return model.draft_to_target(model.logits(normed[0, t - 1:]).argmax(-1)).tolist()


def peagle_loss(model: Eagle3Draft, batch: PEagleBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor,
                *, num_slots: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
    """The weighted P-EAGLE loss (module docstring); same result type and denominators as TTT."""
    rows, t = batch.input_ids.shape
    normed = peagle_forward(model, batch, num_slots)
    counts = slot_counts(batch, num_slots)
    denoms = denominators if denominators is not None else counts
    # Depth 0: exactly EAGLE-3's first TTT step.
    valid = step_valid(batch, 0)
    if chunk_tokens and batch.input_ids.numel() > chunk_tokens:
        ce_sum, pred0 = ChunkedSoftCE.apply(model.logits(normed[:, :t]), target_probs, valid, 1, int(chunk_tokens))
    else:
        logp = torch.log_softmax(model.logits(normed[:, :t]).float(), dim=-1)
        ce_sum = (-(shift(target_probs, 1, 0.0) * logp).sum(-1) * valid).sum()
        pred0 = logp.argmax(-1)
    losses = [ce_sum / max(denoms[0], 1)]
    with torch.no_grad():
        correct = [int(((model.draft_to_target(pred0) == shift(target_argmax, 1, -1)) & valid).sum())]
    # Depth d >= 1: the anchors' slots, [B, A, D, Vd] logits.
    a = batch.anchors.shape[1]
    slot_logp = torch.log_softmax(model.logits(normed[:, t:]).float(), dim=-1).view(rows, a, num_slots - 1, -1)
    for d in range(1, num_slots):
        idx = (batch.anchors + 1 + d).clamp(max=t - 1)  # the target's distribution for x_{a+2+d}
        probs = target_probs.gather(1, idx[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        ok = slot_valid(batch, d)
        logp = slot_logp[:, :, d - 1]
        losses.append((-(probs * logp).sum(-1) * ok).sum() / max(denoms[d], 1))
        with torch.no_grad():
            hit = (model.draft_to_target(logp.argmax(-1)) == target_argmax.gather(1, idx)) & ok
            correct.append(int(hit.sum()))
    loss = sum((step_decay ** d) * lk for d, lk in enumerate(losses))
    return TTTResult(loss=loss, step_loss=[float(lk.detach()) for lk in losses], step_correct=correct,
                     step_count=counts)


class PEagleObjective(nn.Module):
    """The draft plus its P-EAGLE loss, with :class:`~eaglenest.train.ttt.TTTObjective`'s interface
    (``prepare`` draws the anchors, ``counts`` the per-depth denominators, ``forward`` the step).
    ``num_steps`` of forward is the number of slots (the trainer passes ``num_slots``)."""

    def __init__(self, draft: Eagle3Draft, cfg: PEagleConfig, *, seed: int):
        super().__init__()
        self.draft = draft
        self.num_anchors = int(cfg.anchors_per_row)
        self.seed = int(seed)

    def blocks(self) -> list[nn.Module]:
        return [self.draft.midlayer]

    def prepare(self, batch: Batch, *, step: int) -> PEagleBatch:
        return sample_anchors(batch, num_anchors=self.num_anchors, seed=self.seed, step=step)

    def counts(self, batch: PEagleBatch, num_steps: int) -> list[int]:
        return slot_counts(batch, num_steps)

    def forward(self, batch: PEagleBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
        return peagle_loss(self.draft, batch, target_probs, target_argmax, num_slots=num_steps,
                           step_decay=step_decay, denominators=denominators, chunk_tokens=chunk_tokens)


def build_objective(cfg, draft: Eagle3Draft, *, seed: int) -> nn.Module:
    """The training objective of ``cfg.family`` (a TrainConfig) around ``draft``."""
    return PEagleObjective(draft, cfg.peagle, seed=seed) if cfg.family == "peagle" else TTTObjective(draft)


def num_steps(cfg) -> int:
    """Predictions per position the objective of ``cfg.family`` trains: TTT steps or P-EAGLE slots."""
    return cfg.peagle.num_slots if cfg.family == "peagle" else cfg.ttt_steps
