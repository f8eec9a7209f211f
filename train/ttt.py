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

Large vocabularies (``train.target_chunk_tokens``): a batch with more positions than the knob
computes the target distribution chunk by chunk of positions, so the full-vocabulary fp32 logits
exist for one chunk at a time (O(chunk x V_target), not O(B x T x V_target): 2.3 GiB at 4K tokens
and 152K ids), and computes each step's soft cross-entropy over the draft vocab chunk by chunk in
one autograd function that keeps only the draft's logits for backward (in their own dtype) and
reads the target distribution in place (no shifted copy): one [B, T, Vd] tensor saved per step
instead of two fp32 ones, at the same FLOPs (backward recomputes a softmax, no matmul). Both are
row-wise, so results equal the unchunked path's up to summation order (fp32 rounding). Batches at
or under the knob (every toy-recipe batch) take the plain path unchanged.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eaglenest.train.model import Eagle3Draft, attention_window, causal_doc_mask
from eaglenest.train.target import load_target_tensors


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
    def from_pretrained(cls, target_dir: str | Path, keys: dict[str, str] | None = None) -> "TargetHead":
        t = load_target_tensors(target_dir, keys=keys, only=("norm", "lm_head"))
        return cls(t["norm"], t["lm_head"], t["rms_norm_eps"])

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(last_hidden))


@torch.no_grad()
def target_targets(head: TargetHead, last_hidden: torch.Tensor, draft_target_ids: torch.Tensor, *,
                   chunk_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs over the draft vocab [B,T,Vd], full-vocab argmax [B,T]) at every position.

    Restricting then renormalising == softmax over the draft-vocab columns of the logits.
    ``chunk_tokens`` > 0 (``train.target_chunk_tokens``) and fewer than the B*T positions: the
    logits are computed for that many positions at a time, never [B, T, V_target] at once.
    """
    n = last_hidden.numel() // last_hidden.shape[-1]
    if not chunk_tokens or n <= chunk_tokens:
        logits = head(last_hidden.float())
        return torch.softmax(logits[..., draft_target_ids], dim=-1), logits.argmax(-1)
    flat = last_hidden.reshape(n, last_hidden.shape[-1])
    probs, argmax = None, torch.empty(n, dtype=torch.long, device=flat.device)
    for s in range(0, n, chunk_tokens):
        e = min(n, s + chunk_tokens)
        logits = head(flat[s:e].float())              # [C, V_target]: the only full-vocab tensor
        part = torch.softmax(logits[:, draft_target_ids], dim=-1)
        if probs is None:  # the head's dtype (fp32; float64 in tests)
            probs = part.new_empty(n, part.shape[-1])
        probs[s:e] = part
        argmax[s:e] = logits.argmax(-1)
        del logits, part
    return probs.view(*last_hidden.shape[:-1], -1), argmax.view(last_hidden.shape[:-1])


class ChunkedSoftCE(torch.autograd.Function):
    """Soft cross-entropy of the draft's logits against the target distribution, chunk by chunk.

    Inputs: ``logits`` [B, T, Vd] (any float dtype, requires grad), ``probs`` [B, T, Vd] fp32 (the
    UNshifted target distribution), ``valid`` bool [B, T], ``offset`` = 1 + k, ``chunk`` positions.
    Returns (sum over valid (b, t) of -sum_d probs[b, t+offset, d] * log_softmax(logits[b, t])_d,
    argmax of logits[b, t] as long [B, T], 0 where t + offset >= T).

    Forward and backward both run over chunks of one row's positions, so fp32 temporaries are
    [chunk, Vd]; only ``logits`` is saved (``probs`` and ``valid`` are the caller's tensors, no
    copies). Backward recomputes each chunk's log-softmax (no matmul) and forms
    d/dz of -sum_d p_d log_softmax(z)_d = softmax(z) * sum_d p_d - p as autograd's log_softmax
    backward does.
    """

    @staticmethod
    def forward(ctx, logits, probs, valid, offset: int, chunk: int):
        b_rows, t = logits.shape[:2]
        total = torch.zeros((), dtype=torch.promote_types(probs.dtype, torch.float32), device=logits.device)
        pred = torch.zeros(b_rows, t, dtype=torch.long, device=logits.device)
        for b, s, e in _chunks(b_rows, t - offset, chunk):
            logp = torch.log_softmax(logits[b, s:e].float(), dim=-1)
            ce = -(probs[b, s + offset:e + offset] * logp).sum(-1)
            total += (ce * valid[b, s:e]).sum()
            pred[b, s:e] = logp.argmax(-1)
        ctx.save_for_backward(logits, probs, valid)
        ctx.offset, ctx.chunk = offset, chunk
        ctx.mark_non_differentiable(pred)
        return total, pred

    @staticmethod
    def backward(ctx, grad_total, _grad_pred):
        logits, probs, valid = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        if grad_total is None:
            return grad, None, None, None, None
        for b, s, e in _chunks(logits.shape[0], logits.shape[1] - ctx.offset, ctx.chunk):
            logp = torch.log_softmax(logits[b, s:e].float(), dim=-1)
            # d loss / d logp, then log_softmax's backward (g - exp(logp) * sum(g)), in the order
            # autograd takes them; in place, so a chunk needs two [chunk, Vd] temporaries.
            g = (probs[b, s + ctx.offset:e + ctx.offset] * (valid[b, s:e, None] * grad_total)).neg_().to(logp.dtype)
            g -= logp.exp_().mul_(g.sum(-1, keepdim=True))
            grad[b, s:e] = g
        return grad, None, None, None, None


def _chunks(rows: int, positions: int, chunk: int):
    """(row, start, end) over the first ``positions`` positions of each row, ``chunk`` at a time."""
    for b in range(rows):
        for s in range(0, max(positions, 0), chunk):
            yield b, s, min(positions, s + chunk)


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
             denominators: list[float] | None = None, chunk_tokens: int = 0) -> TTTResult:
    """The weighted TTT loss of ``num_steps`` unrolled steps (see the module docstring).

    ``denominators``: per-step valid counts of the GLOBAL batch when this batch is one rank's
    part of it; the local losses then sum over ranks to the global loss (and so do gradients).
    Default: this batch's own counts. ``chunk_tokens`` (``train.target_chunk_tokens``): batches
    with more positions compute each step's loss with :class:`ChunkedSoftCE`.
    """
    chunked = bool(chunk_tokens) and batch.input_ids.numel() > chunk_tokens
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
        n = int(valid.sum())
        denom = denominators[k] if denominators is not None else n
        if chunked:
            ce_sum, draft_pred = ChunkedSoftCE.apply(model.logits(normed), target_probs, valid, 1 + k,
                                                     int(chunk_tokens))
            lk = ce_sum / max(denom, 1)
        else:
            logp = torch.log_softmax(model.logits(normed).float(), dim=-1)
            probs = shift(target_probs, 1 + k, 0.0)
            ce = -(probs * logp).sum(-1)
            lk = (ce * valid).sum() / max(denom, 1)
            draft_pred = logp.argmax(-1)
        loss = loss + (step_decay ** k) * lk
        with torch.no_grad():
            pred = model.draft_to_target(draft_pred)
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

    def prepare(self, batch: Batch, *, step: int) -> Batch:
        """The batch as :meth:`forward` takes it (the P-EAGLE objective adds its anchors here)."""
        del step
        return batch

    def counts(self, batch: Batch, num_steps: int) -> list[int]:
        """Valid predictions per step of a prepared batch: this rank's share of the denominators."""
        return valid_counts(batch, num_steps)

    def forward(self, batch: Batch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
        return ttt_loss(self.draft, batch, target_probs, target_argmax, num_steps=num_steps,
                        step_decay=step_decay, denominators=denominators, chunk_tokens=chunk_tokens)
