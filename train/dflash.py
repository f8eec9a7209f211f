"""DFlash (``train.family=dflash``): a small block drafter over the target's hidden states, every
token of a round in ONE forward, trained from the same features table as EAGLE-3.

What vLLM 0.32 serves (``speculative_config`` ``{"method": "dflash"}``; the model is
``model_executor/models/qwen3_dflash.py``, the proposer ``v1/spec_decode/dflash.py`` with its input
kernel ``copy_and_expand_dflash_inputs_kernel``). After a verification that ends with the bonus
token x_p at position pos(p) (the target has read x_0..x_{p-1}):

* context: every earlier position s < p of the request contributes one key/value per draft layer,
  computed from the target's features alone: ``c_s = hidden_norm(fc(aux_s))`` (``fc`` over the aux
  layers concatenated, [H, n_aux*H]), then that layer's ``k_norm(k_proj(c_s))`` rotated at pos(s)
  and ``v_proj(c_s)`` (no ``input_layernorm``: the keys are written to the KV cache directly);
  (one ``k_norm`` shared by all layers here: see :class:`DFlashDraft`);
* the block: ``block_size`` = K + 1 query tokens, slot 0 the bonus token x_p, slots 1..K the mask
  token, at positions pos(p)..pos(p)+K. Their input is the target's (frozen) token embedding only;
  each draft layer is a Qwen3 decoder layer (input_layernorm, q/k/v with per-head ``q_norm`` /
  ``k_norm``, rotary, o_proj, residual, post_attention_layernorm, SiLU MLP, residual) whose queries
  attend to the context keys AND to every key of the block (non-causal inside the block);
* ``norm`` then ``lm_head`` (draft vocabulary, ``d2t``) on slots 1..K: slot k proposes x_{p+k}
  (``sample_from_anchor`` is false: slot 0 is not sampled).

Training (the anchor p is the real token's position): anchors are drawn per packed row, each gets
its block, and slot k is trained on the target's distribution for x_{p+k} (the target head at
position p+k-1) with soft cross-entropy, weight ``train.step_decay ** (k-1)``, each slot averaged
over its valid predictions (denominators global across ranks). All blocks of a row are ONE forward
over the row's context keys plus the A x block_size query slots with the explicit mask of
:func:`block_mask` (a dense [A*bs, T + A*bs] per row: small, the context is keys only).

The features are the aux layers the EAGLE-3 capture stores, in vLLM's aux convention (id i = the
input of target layer i); the export writes ``dflash_config.target_layer_ids`` = i - 1 because
vLLM adds 1 to DFlash's ids. Aux id 0 (the embeddings) has no DFlash id and is refused.

Anchor choice is a pure function of (seed, step, row tokens), so it does not depend on the rank
count or on a resume.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from eaglenest.errors import ConfigError, SchemaError
from eaglenest.train.config import DFlashConfig
from eaglenest.train.model import DraftHead, apply_rotary, head_dim_of, rotary_dim, rotary_embedding
from eaglenest.train.peagle import draw_anchors, resolve_mask_token
from eaglenest.train.ttt import Batch, TTTResult, shift


def is_dflash(cfg) -> bool:
    """A DFlash draft config (``train.family=dflash``)."""
    return bool(getattr(cfg, "dflash", False))


def mask_token_id(cfg: DFlashConfig, target_cfg: dict[str, Any]) -> int:
    """``train.dflash.mask_token_id``, or the first of the target's pad/eos token ids in its vocabulary."""
    return resolve_mask_token(cfg.mask_token_id, target_cfg, "train.dflash.mask_token_id")


def check_layers(layer_ids) -> None:
    """DFlash reads target layer OUTPUTS (vLLM id - 1 >= 0): a table whose aux layers include 0
    (the embeddings) cannot feed it. Refused naming the layers and the capture that adds others."""
    ids = sorted(int(i) for i in layer_ids)
    if not ids or ids[0] < 1:
        good = [i for i in ids if i >= 1] or [2]
        raise SchemaError(f"train.family=dflash: the features table's aux layers {ids} include 0 (the embeddings), "
                          "which DFlash cannot read (its target_layer_ids are layer outputs, vLLM id - 1); "
                          f"capture layers >= 1, e.g. `featurestore capture featurestore.layer_ids={good}`")


def configure(draft_cfg, cfg: DFlashConfig, target_cfg: dict[str, Any]) -> None:
    """Mark a draft config (from :func:`eaglenest.train.model.draft_config`) as DFlash."""
    check_layers(draft_cfg.eagle_aux_layer_ids)
    if "sliding_attention" in (getattr(draft_cfg, "layer_types", None) or ()):
        raise ConfigError("train.sliding_window: must be 0 for train.family=dflash (its layers attend to the "
                          "whole context)")
    draft_cfg.dflash = True
    draft_cfg.num_hidden_layers = int(cfg.num_layers)
    draft_cfg.mask_token_id = mask_token_id(cfg, target_cfg)
    draft_cfg.dflash_block_size = int(cfg.block_size)
    draft_cfg.head_dim = head_dim_of(draft_cfg)
    # vLLM's DFlash layer has a bias-free MLP (Qwen2MLP) and its loader drops unexpected biases without a
    # word: a target's mlp_bias would train biases vLLM never serves. (Its attention keeps attention_bias.)
    draft_cfg.mlp_bias = False


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm) whose keys are [context ; block]."""

    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.rotary_dim = rotary_dim(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        h, hd = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=bias)
        self.q_norm = LlamaRMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(hd, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated normed keys, values) [B, kvh, T, d] of inputs x [B, T, H]."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads))
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        _, k = apply_rotary(k, k, cos, sin, self.rotary_dim)
        return k, v

    def forward(self, x, ctx, cos_q, sin_q, cos_c, sin_c, mask):
        """x [B, S, H] (normed block inputs), ctx [B, T, H] (context states), mask bool [B, S, T+S]."""
        q = self.q_norm(self._heads(self.q_proj(x), self.num_heads))
        q, _ = apply_rotary(q, q, cos_q, sin_q, self.rotary_dim)
        kc, vc = self.keys(ctx, cos_c, sin_c)
        kb, vb = self.keys(x, cos_q, sin_q)
        rep = self.num_heads // self.num_kv_heads
        k = torch.cat([kc, kb], dim=2).repeat_interleave(rep, dim=1)
        v = torch.cat([vc, vb], dim=2).repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5
        p = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
        out = torch.matmul(p, v)
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    """vLLM's ``DFlashQwen3DecoderLayer`` (pre-norm residual block)."""

    def __init__(self, cfg):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, h, ctx, cos_q, sin_q, cos_c, sin_c, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos_q, sin_q, cos_c, sin_c, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(DraftHead):
    """fc + hidden_norm over the aux features (the context), ``num_layers`` Qwen3 layers over the
    block, final norm, lm_head over the draft vocabulary. Parameter names are vLLM's (``layers.N.*``,
    ``fc``, ``hidden_norm``, ``norm``, ``lm_head``) so the export renames nothing."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        h, th = cfg.hidden_size, cfg.target_hidden_size
        n_aux = len(cfg.eagle_aux_layer_ids)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(n_aux * th, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        # One k_norm for all layers (exported under each layer's name, identical): vLLM 0.32 on CPU
        # norms every layer's context keys with layer 0's k_norm weight (its grouped rms_norm kernel
        # ignores the per-layer weights), so per-layer weights would be served with a skew there;
        # tied, CPU and per-layer (GPU) kernels compute the same. docs/serve.md, "DFlash drafts".
        for layer in self.layers[1:]:
            layer.self_attn.k_norm = self.layers[0].self_attn.k_norm
        self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = rotary_embedding(cfg)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # Read by code shared with EAGLE-3 drafts (init, P-EAGLE checks): DFlash has none of these.
        self.mask_hidden = None

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*H_target] -> the context states hidden_norm(fc(aux)) [..., H]."""
        return self.hidden_norm(self.fc(aux))

    #: The name the offline estimator (eaglenest.evaluate.offline) calls on every draft's features.
    combine = context

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor,
                ctx_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block tokens/positions [B, S], context states [B, T, H] at ``ctx_positions`` [B, T],
        mask bool [B, S, T+S] -> normed outputs [B, S, H]."""
        h = self.embed_tokens(tokens).to(ctx.dtype)
        cos_q, sin_q = self.rotary_emb(h, positions)
        cos_c, sin_c = self.rotary_emb(ctx, ctx_positions)
        for layer in self.layers:
            h = layer(h, ctx, cos_q, sin_q, cos_c, sin_c, mask)
        return self.norm(h)



@dataclasses.dataclass
class DFlashBatch(Batch):
    """A batch with its anchors: ``anchors`` long [B, A] (positions of slot 0's real token),
    ``anchor_ok`` bool [B, A] (False: padding, the row had fewer candidates)."""

    anchors: torch.Tensor = None
    anchor_ok: torch.Tensor = None


def slot_valid(batch: Batch, k: int) -> torch.Tensor:
    """bool [B, T]: an anchor at p has a valid slot k: x_{p+k} exists, is a loss token of p's document."""
    return (shift(batch.loss_mask, k, False) & (shift(batch.doc_ids, k, -2) == batch.doc_ids)
            & (batch.doc_ids >= 0))


def anchor_candidates(batch: Batch) -> torch.Tensor:
    """bool [B, T]: positions p with context (p-1 in p's document) and a valid slot 1."""
    has_ctx = torch.zeros_like(batch.loss_mask)
    has_ctx[:, 1:] = batch.doc_ids[:, 1:] == batch.doc_ids[:, :-1]
    return has_ctx & slot_valid(batch, 1)


#: Salt of DFlash's anchor draw (an int: a str's hash changes with PYTHONHASHSEED, per process).
ANCHOR_SALT = (1,)


def sample_anchors(batch: Batch, *, num_anchors: int, seed: int, step: int) -> DFlashBatch:
    """Up to ``num_anchors`` anchors per row among :func:`anchor_candidates`, without replacement,
    ascending; the draw depends on (seed, step, the row's tokens) only."""
    return DFlashBatch(**draw_anchors(anchor_candidates(batch), batch, num_anchors=num_anchors, seed=seed,
                                      step=step, salt=ANCHOR_SALT))


def block_inputs(batch: DFlashBatch, block_size: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, positions) [B, A*bs] of the blocks, anchor-major: slot k of anchor i is column
    i*bs + k; slot 0 is x_p, the rest ``mask_id``; positions pos(p) + k."""
    rows, a = batch.anchors.shape
    first = batch.input_ids.gather(1, batch.anchors)
    tokens = first[:, :, None].repeat(1, 1, block_size)
    tokens[:, :, 1:] = mask_id
    k = torch.arange(block_size, device=batch.anchors.device)
    positions = batch.position_ids.gather(1, batch.anchors)[:, :, None] + k
    return tokens.view(rows, a * block_size), positions.view(rows, a * block_size)


def block_mask(batch: DFlashBatch, block_size: int, *, causal: bool = False) -> torch.Tensor:
    """bool [B, A*bs, T + A*bs]: block query (i, k) may see context key s (s < p_i, in p_i's
    document) and block key (i', k') when i' == i (every slot of its own block; with ``causal``
    only k' <= k, the block-causal attention a mis-flagged export would serve). A padding anchor
    sees only its block (its loss is masked)."""
    doc = batch.doc_ids
    rows, t = doc.shape
    a = batch.anchors.shape[1]
    s = a * block_size
    anchor = batch.anchors.repeat_interleave(block_size, dim=1)  # [B, S]
    keys = torch.arange(t, device=doc.device)
    ctx = (keys[None, None, :] < anchor[:, :, None]) & (doc[:, None, :] == doc.gather(1, anchor)[:, :, None])
    ctx &= batch.anchor_ok.repeat_interleave(block_size, dim=1)[:, :, None]
    blk = torch.arange(s, device=doc.device) // block_size
    own = blk[:, None] == blk[None, :]
    if causal:
        own &= torch.arange(s, device=doc.device)[None, :] <= torch.arange(s, device=doc.device)[:, None]
    return torch.cat([ctx, own.expand(rows, s, s)], dim=-1)


def dflash_forward(model: DFlashDraft, batch: DFlashBatch, block_size: int) -> torch.Tensor:
    """The draft's one forward over every block of the batch: normed outputs [B, A*bs, H]."""
    dtype = model.fc.weight.dtype
    tokens, positions = block_inputs(batch, block_size, int(model.config.mask_token_id))
    ctx = model.context(batch.aux.to(dtype))
    return model(tokens, positions, ctx, batch.position_ids, block_mask(batch, block_size))


@torch.no_grad()
def propose(model: DFlashDraft, seq: list[int], ctx: torch.Tensor, k: int) -> list[int]:
    """vLLM's DFlash round for one request, as the offline estimator replays it: the verified
    tokens ``seq`` (``ctx`` [len(seq)-1, H]: the context states of seq[:-1], positions 0..), the
    block [seq[-1], mask x k] at positions len(seq)-1.., every slot seeing the whole context and
    block; returns the k greedy proposals of slots 1..k (target ids)."""
    t = ctx.shape[0]
    assert t == len(seq) - 1, (t, len(seq))
    tokens = torch.tensor([[seq[-1]] + [int(model.config.mask_token_id)] * k])
    positions = torch.arange(t, t + k + 1)[None]
    mask = torch.ones(1, k + 1, t + k + 1, dtype=torch.bool)
    normed = model(tokens, positions, ctx[None], torch.arange(t)[None], mask)
    return model.draft_to_target(model.logits(normed[0, 1:]).argmax(-1)).tolist()


def slot_counts(batch: DFlashBatch, block_size: int) -> list[int]:
    """Valid predictions per slot 1..bs-1 (the per-slot denominators)."""
    return [int((slot_valid(batch, k).gather(1, batch.anchors) & batch.anchor_ok).sum())
            for k in range(1, block_size)]


def dflash_loss(model: DFlashDraft, batch: DFlashBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor,
                *, block_size: int, step_decay: float, denominators: list[float] | None = None) -> TTTResult:
    """The weighted DFlash loss (module docstring); entry j of the per-step lists is slot j + 1."""
    rows, t = batch.input_ids.shape
    a = batch.anchors.shape[1]
    normed = dflash_forward(model, batch, block_size).view(rows, a, block_size, -1)
    counts = slot_counts(batch, block_size)
    denoms = denominators if denominators is not None else counts
    losses, correct = [], []
    for k in range(1, block_size):
        idx = (batch.anchors + k - 1).clamp(max=t - 1)  # the target's distribution for x_{p+k}
        probs = target_probs.gather(1, idx[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        ok = slot_valid(batch, k).gather(1, batch.anchors) & batch.anchor_ok
        logp = torch.log_softmax(model.logits(normed[:, :, k]).float(), dim=-1)
        losses.append((-(probs * logp).sum(-1) * ok).sum() / max(denoms[k - 1], 1))
        with torch.no_grad():
            hit = (model.draft_to_target(logp.argmax(-1)) == target_argmax.gather(1, idx)) & ok
            correct.append(int(hit.sum()))
    loss = sum((step_decay ** j) * lk for j, lk in enumerate(losses))
    return TTTResult(loss=loss, step_loss=[float(lk.detach()) for lk in losses], step_correct=correct,
                     step_count=counts)


class DFlashObjective(nn.Module):
    """The draft plus its DFlash loss, with :class:`~eaglenest.train.ttt.TTTObjective`'s interface
    (``prepare`` draws the anchors, ``counts`` the per-slot denominators, ``forward`` the step).
    ``num_steps`` of forward is the block size (the trainer passes :func:`num_steps` + 1)."""

    def __init__(self, draft: DFlashDraft, cfg: DFlashConfig, *, seed: int):
        super().__init__()
        self.draft = draft
        self.num_anchors = int(cfg.anchors_per_row)
        self.block_size = int(cfg.block_size)
        self.seed = int(seed)

    def blocks(self) -> list[nn.Module]:
        return list(self.draft.layers)

    def prepare(self, batch: Batch, *, step: int) -> DFlashBatch:
        return sample_anchors(batch, num_anchors=self.num_anchors, seed=self.seed, step=step)

    def counts(self, batch: DFlashBatch, num_steps: int) -> list[int]:
        del num_steps
        return slot_counts(batch, self.block_size)

    def forward(self, batch: DFlashBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
        del num_steps, chunk_tokens  # the block size is the objective's; logits are [A*(bs-1), Vd] only
        return dflash_loss(self.draft, batch, target_probs, target_argmax, block_size=self.block_size,
                           step_decay=step_decay, denominators=denominators)


def num_steps(cfg) -> int:
    """Predictions per anchor (``train.dflash.block_size`` - 1): the per-slot metrics' length."""
    return int(cfg.dflash.block_size) - 1


__all__ = ["DFlashAttention", "DFlashBatch", "DFlashDraft", "DFlashLayer", "DFlashObjective", "anchor_candidates",
           "block_inputs", "block_mask", "check_layers", "configure", "dflash_forward", "dflash_loss", "is_dflash",
           "mask_token_id", "num_steps", "propose", "sample_anchors", "slot_counts", "slot_valid"]
