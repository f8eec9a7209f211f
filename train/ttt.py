"""The training-time-test (TTT) objective: K unrolled draft steps per position, one pass per step.

Indexing (sequence x_0..x_{T-1}, fused target features g_t = fc(aux_t), target last hidden h_t):

* chain t, step 0: hidden g_t, token x_{t+1}, rotary position pos(t); predicts x_{t+2}.
* chain t, step k: hidden = chain t's own step k-1 output, token x_{t+1+k}, position pos(t)+k;
  predicts x_{t+2+k}.
* attention of (t, k): step-0 keys at positions s <= t of the same document, plus chain t's own
  keys of steps 1..k. That is what vLLM sees when drafting: context KV up to the last verified
  position, then its own drafted positions.
* loss of (t, k): cross-entropy of the draft distribution (draft vocab) against the target's
  next-token distribution at position t+1+k, softmax(lm_head(final_norm(h_{t+1+k}))) restricted
  to the draft vocab and renormalised; counted only where t+2+k < T, loss_mask[t+2+k] == 1 and
  x_{t+2+k} is in chain t's document. Step weight decay**k; mean over valid positions per step.

All chains advance together: step k is one batched forward over [B, T] with a dense step-0 mask
plus k "diagonal" keys (see :class:`eaglenest.train.model.DraftAttention`). Memory grows with K
(activations of every step are kept for backward); that is the price of exact TTT gradients.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eaglenest.train.model import Eagle3Draft, attention_window, causal_doc_mask


@dataclasses.dataclass
class Batch:
    """Padded and/or packed rows. Padding: doc_ids == -1, loss_mask == 0."""

    input_ids: torch.Tensor      # long [B, T]
    loss_mask: torch.Tensor      # bool [B, T]
    doc_ids: torch.Tensor        # long [B, T]
    position_ids: torch.Tensor   # long [B, T], restart at 0 for each packed document
    aux: torch.Tensor            # float [B, T, n_aux*H], aux layers in ascending id order
    last_hidden: torch.Tensor    # float [B, T, H], target last block output before final norm


@dataclasses.dataclass
class TTTResult:
    loss: torch.Tensor           # scalar, weighted sum of per-step means
    step_loss: list[float]
    step_correct: list[int]
    step_count: list[int]

    @property
    def step_acc(self) -> list[float]:
        return [c / n if n else float("nan") for c, n in zip(self.step_correct, self.step_count)]


class TargetHead(nn.Module):
    """The target's final norm and lm_head, frozen: last hidden -> full-vocab logits."""

    def __init__(self, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor, eps: float):
        super().__init__()
        self.norm = LlamaRMSNorm(norm_weight.shape[0], eps=eps)
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(norm_weight.float())
            self.lm_head.weight.copy_(lm_head_weight.float())
        self.requires_grad_(False)

    @classmethod
    def from_pretrained(cls, target_dir: str | Path) -> "TargetHead":
        from eaglenest.train.target import load_target_tensors

        t = load_target_tensors(target_dir)
        return cls(t["norm"], t["lm_head"], t["rms_norm_eps"])

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(last_hidden))


@torch.no_grad()
def target_targets(head: TargetHead, last_hidden: torch.Tensor,
                   draft_target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs over the draft vocab [B,T,Vd], full-vocab argmax [B,T]) at every position.

    Restricting then renormalising == softmax over the draft-vocab columns of the logits.
    """
    logits = head(last_hidden.float())
    return torch.softmax(logits[..., draft_target_ids], dim=-1), logits.argmax(-1)


def shift(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """out[:, t] = x[:, t+n] (dim 1), ``fill`` beyond the end."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_valid(batch: Batch, k: int) -> torch.Tensor:
    """bool [B, T]: (t, k) predicts x_{t+2+k}, which exists, is a loss token, in t's document."""
    return (shift(batch.loss_mask, 2 + k, False)
            & (shift(batch.doc_ids, 2 + k, -2) == batch.doc_ids) & (batch.doc_ids >= 0))


def valid_counts(batch: Batch, num_steps: int) -> list[int]:
    """Number of valid (row, t) per step: the per-step denominators of a batch."""
    return [int(step_valid(batch, k).sum()) for k in range(num_steps)]


def ttt_loss(model: Eagle3Draft, batch: Batch, target_probs: torch.Tensor,
             target_argmax: torch.Tensor, *, num_steps: int, step_decay: float,
             denominators: list[float] | None = None) -> TTTResult:
    """The weighted TTT loss of ``num_steps`` unrolled steps (see the module docstring).

    ``denominators``: per-step valid counts of the GLOBAL batch when this batch is one rank's
    part of it; the local losses then sum over ranks to the global loss (and so do gradients).
    Default: this batch's own counts.
    """
    # Long rows pass the doc ids: the attention then builds its mask per query chunk.
    chunk = int(getattr(model.config, "attn_chunk_tokens", 2048) or 2048)
    window = attention_window(model.config)
    mask = causal_doc_mask(batch.doc_ids, window=window) if batch.doc_ids.shape[1] <= chunk else batch.doc_ids
    hidden = model.combine(batch.aux.to(model.fc.weight.dtype))
    cache: list = []
    loss = hidden.new_zeros(())
    step_loss, step_correct, step_count = [], [], []
    for k in range(num_steps):
        tokens = shift(batch.input_ids, 1 + k, 0)
        normed, next_hidden = model.step(tokens, hidden, batch.position_ids + k, cache, mask)
        # (t, k) predicts x_{t+2+k}: valid iff it exists, is a loss token, same document.
        valid = step_valid(batch, k)
        logp = torch.log_softmax(model.logits(normed).float(), dim=-1)
        probs = shift(target_probs, 1 + k, 0.0)
        ce = -(probs * logp).sum(-1)
        n = int(valid.sum())
        denom = denominators[k] if denominators is not None else n
        lk = (ce * valid).sum() / max(denom, 1)
        loss = loss + (step_decay ** k) * lk
        with torch.no_grad():
            pred = model.draft_to_target(logp.argmax(-1))
            correct = (pred == shift(target_argmax, 1 + k, -1)) & valid
        step_loss.append(float(lk.detach()))
        step_correct.append(int(correct.sum()))
        step_count.append(n)
        hidden = next_hidden
    return TTTResult(loss=loss, step_loss=step_loss, step_correct=step_correct, step_count=step_count)


class TTTObjective(nn.Module):
    """The draft plus its TTT loss as one module whose ``forward`` is a whole training step.

    FSDP2 unshards a module's parameters around ``forward``; the TTT loop calls several draft
    methods (``combine``, ``step``, ``logits``), so the root of the FSDP tree is this wrapper and
    the draft's block is the inner unit (called K times per forward).
    """

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def blocks(self) -> list[nn.Module]:
        return [self.draft.midlayer]

    def forward(self, batch: Batch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None
                ) -> TTTResult:
        return ttt_loss(self.draft, batch, target_probs, target_argmax, num_steps=num_steps,
                        step_decay=step_decay, denominators=denominators)
