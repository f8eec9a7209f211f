"""The EAGLE-3 draft head, computed exactly as vLLM's ``llama_eagle3.py`` computes it at inference.

Shape of one draft step (H = draft hidden size, usually the target's)::

    g      = fc(aux)                        # step 0 only: [n_aux*H] -> [H]
    x      = cat(input_layernorm(embed(tok)), hidden_norm(hidden))       # [2H], the qkv input
    res    = hidden                         # or hidden_norm(hidden) with norm_before_residual
    res    = res + o_proj(attn(x))
    res    = res + mlp(post_attention_layernorm(res))
    normed = norm(res)                      # -> lm_head (draft vocab)
    next   = res                            # or normed with norm_output: the next step's hidden

Norms, rotary embedding and MLP are Hugging Face Llama modules used by import; the attention is
written here because it takes a 2H input and, in training, the training-time-test (TTT) layout:
step 0 attends causally over the whole sequence, step k>0 additionally to the same chain's own
keys of steps 1..k ("diagonal" entries), see :mod:`eaglenest.train.ttt`. The trade-off: a
dense [T, T] score matrix per head (simple, exact, fine up to a few thousand tokens per row)
instead of a flex/flash kernel.

Embeddings are the target's and frozen. The draft module holds no globals and its single block is
a submodule (``midlayer``), so FSDP2 ``fully_shard(model.midlayer)`` then ``fully_shard(model)``
applies as for any stack of blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from eaglenest.errors import ConfigError
from eaglenest.train.spec import DraftFlags, DraftShape

#: Keys copied from the target's (language) config into the draft's. Attention and MLP sizes are
#: not among them: :func:`draft_shape` sets those, and the rotary settings come from :func:`draft_rope`;
#: nor the MLP's activation: the draft's is silu (LlamaConfig's), the one vLLM's draft layers run.
TARGET_KEYS = ("hidden_size", "rms_norm_eps", "max_position_embeddings", "vocab_size",
               "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")
#: Config keys that make a target a mixture of experts (any of them > 1).
MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
#: MLP width of a MoE target's draft, as a multiple of hidden_size (rounded up to 64).
MOE_MLP_RATIO = 1.75
#: Most heads an MLA target's draft gets.
MLA_MAX_HEADS = 64


def is_moe(target_cfg: dict[str, Any]) -> bool:
    return any(int(target_cfg.get(k) or 0) > 1 for k in MOE_KEYS)


def is_mla(target_cfg: dict[str, Any]) -> bool:
    return target_cfg.get("kv_lora_rank") is not None


def draft_shape(target_cfg: dict[str, Any], override: DraftShape = DraftShape()) -> dict[str, int]:
    """The draft layer's attention and MLP sizes (docs/targets.md, "Draft sizing").

    * dense targets with ordinary attention: the target's own head_dim, head counts and
      intermediate_size (what vLLM's speculators and SpecForge do for Llama/Qwen);
    * MLA targets (DeepSeek-V3, Kimi-K2): their head_dim fields describe a latent attention the
      draft does not have (transformers even writes head_dim = qk_rope_head_dim), so the draft gets
      plain multi-head attention with head_dim = v_head_dim (else 128) and
      min(target heads, 64) heads;
    * MoE targets: the dense intermediate_size of a MoE config is not the width of anything the
      draft imitates (18432 on DeepSeek-V3 would make a ~1B-parameter head), so the MLP is
      1.75 x hidden (rounded up to 64), the ratio of TorchSpec's Kimi-K2.5 draft (12288 at 7168).

    ``override`` (``train.draft.*``) replaces any of the four.
    """
    hidden = int(target_cfg["hidden_size"])
    heads = int(target_cfg["num_attention_heads"])
    if is_mla(target_cfg):
        head_dim = int(target_cfg.get("v_head_dim") or 128)
        heads = max(1, min(heads, MLA_MAX_HEADS))
        kv = heads
    else:
        head_dim = int(target_cfg.get("head_dim") or hidden // heads)
        kv = int(target_cfg.get("num_key_value_heads") or heads)
    if is_moe(target_cfg) or not target_cfg.get("intermediate_size"):
        inter = -(-int(math.ceil(MOE_MLP_RATIO * hidden)) // 64) * 64
    else:
        inter = int(target_cfg["intermediate_size"])
    shape = {"intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim}
    for key in shape:
        if getattr(override, key):
            shape[key] = int(getattr(override, key))
    if override.num_attention_heads and not override.num_key_value_heads and is_mla(target_cfg):
        shape["num_key_value_heads"] = shape["num_attention_heads"]
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ConfigError(f"train.draft: {shape['num_attention_heads']} attention heads are not a multiple of "
                          f"{shape['num_key_value_heads']} key/value heads")
    _check_rotary_dims(shape["head_dim"], rotary_fraction(target_cfg))
    return shape


def _check_rotary_dims(head_dim: int, fraction: float) -> None:
    """The dims each head rotates (vLLM: int(head_dim x partial_rotary_factor)) come in pairs: an odd
    or empty count fails in the first forward, far from the key that made it."""
    rot = int(head_dim * fraction)
    if fraction < 1 and (rot < 2 or rot % 2):
        raise ConfigError(f"train.draft.head_dim: {head_dim} x the target's partial rotary factor {fraction} is "
                          f"{rot} rotated dims, not an even number >= 2: pick a head_dim that makes it one "
                          "(or 0 for the target's)")


def rotary_fraction(target_cfg: dict[str, Any]) -> float:
    """Share of each head's dims the target rotates (1.0 = all). Read from wherever checkpoints
    put it: ``rope_parameters.partial_rotary_factor``, the top-level ``partial_rotary_factor`` /
    ``rotary_pct`` / ``rotary_emb_fraction`` (names vLLM also reads), or MiniMax's ``rotary_dim``."""
    rope = target_cfg.get("rope_parameters") if isinstance(target_cfg.get("rope_parameters"), dict) else {}
    for value in (rope.get("partial_rotary_factor"), target_cfg.get("partial_rotary_factor"),
                  target_cfg.get("rotary_pct"), target_cfg.get("rotary_emb_fraction")):
        if value is not None:
            return float(value)
    if target_cfg.get("rotary_dim") and target_cfg.get("head_dim"):
        return int(target_cfg["rotary_dim"]) / int(target_cfg["head_dim"])
    return 1.0


def draft_rope(target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The draft's ``rope_parameters``: the target's theta and scaling as transformers resolves them (a
    legacy ``rope_scaling`` in place of ``rope_parameters``, a legacy ``rope_theta`` folded in), with
    ``partial_rotary_factor`` written out when the target rotates only part of each head. vLLM's Llama
    reads exactly this dict (``get_rope``: rotary_dim = head_dim x partial_rotary_factor, neox style),
    and :class:`DraftAttention` applies the same."""
    rope = target_cfg.get("rope_parameters")
    legacy = target_cfg.get("rope_scaling")
    if isinstance(legacy, dict) and legacy:
        # transformers (and vLLM, which loads config.json through it) run a legacy rope_scaling in place of
        # rope_parameters when a config has both: its type and factor, theta from the top level or 10000.
        rope = {"rope_type" if k == "type" else k: v for k, v in legacy.items()}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        # Per-layer-type parameters (gpt-oss style sliding/full): the draft is one full-attention layer.
        rope = rope.get("full_attention") or next(iter(rope.values()))
    out = dict(rope) if isinstance(rope, dict) else {}
    if "rope_theta" not in out:
        out["rope_theta"] = float(target_cfg.get("rope_theta") or 10000.0)
    out.setdefault("rope_type", "default")
    if out["rope_type"] in ("llama3", "yarn", "longrope") and target_cfg.get("original_max_position_embeddings"):
        # A top-level pretraining length (Phi-3 / Phi-4-mini) has priority in transformers, and in vLLM through it.
        out["original_max_position_embeddings"] = int(target_cfg["original_max_position_embeddings"])
    if out["rope_type"] in ("mrope", "default") and "mrope_section" in out:
        out.pop("mrope_section")  # multimodal 3-D positions: text tokens use the 1-D rotary
        out.pop("mrope_interleaved", None)
        out["rope_type"] = "default"
    frac = rotary_fraction(target_cfg)
    if not 0 < frac <= 1:
        raise ConfigError(f"run.target: partial rotary factor {frac} is not in (0, 1]")
    if frac < 1:
        out["partial_rotary_factor"] = frac
    else:
        out.pop("partial_rotary_factor", None)
    return out


def draft_config(target_cfg: dict[str, Any], *, draft_vocab_size: int, layer_ids: tuple[int, ...],
                 flags: DraftFlags, sliding_window: int = 0, shape: DraftShape = DraftShape()) -> LlamaConfig:
    """A one-layer Llama config for the draft, derived from the target's (language) config dict.

    ``sliding_window`` > 0 makes the layer a sliding-window attention layer (``layer_types``
    ``["sliding_attention"]``, as vLLM's Llama reads it): each query sees the last
    ``sliding_window`` positions, itself included."""
    kw = {k: target_cfg[k] for k in TARGET_KEYS if target_cfg.get(k) is not None}
    cfg = LlamaConfig(**kw, **draft_shape(target_cfg, shape), rope_parameters=draft_rope(target_cfg),
                      num_hidden_layers=1, tie_word_embeddings=False)
    cfg.draft_vocab_size = int(draft_vocab_size)
    cfg.target_hidden_size = int(target_cfg["hidden_size"])
    cfg.eagle_aux_layer_ids = [int(i) for i in layer_ids]
    for f in dataclasses.fields(flags):
        setattr(cfg, f.name, bool(getattr(flags, f.name)))
    if sliding_window > 0:
        cfg.sliding_window = int(sliding_window)
        cfg.layer_types = ["sliding_attention"]
    return cfg


def rotary_dim(cfg) -> int:
    """Dims of each head the draft rotates (vLLM: int(head_dim * partial_rotary_factor))."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    return int(head_dim_of(cfg) * float(rope.get("partial_rotary_factor", 1.0) or 1.0))


def rotary_embedding(cfg) -> nn.Module:
    """Hugging Face's Llama rotary embedding over the rotated dims only. Its frequencies follow
    the head size it is given, so a partial rotary gets a config whose head_dim is the rotary dim
    (as vLLM's ``get_rope`` builds frequencies over rotary_dim)."""
    rot = rotary_dim(cfg)
    if rot != head_dim_of(cfg):
        cfg = copy.deepcopy(cfg)
        cfg.head_dim = rot
        cfg.rope_parameters = {k: v for k, v in cfg.rope_parameters.items() if k != "partial_rotary_factor"}
    return _static_frequencies(LlamaRotaryEmbedding(cfg), cfg)


def _static_frequencies(emb: nn.Module, cfg) -> nn.Module:
    """``emb`` with the frequencies vLLM serves with, fixed. Hugging Face switches LongRoPE between its short and
    long factors, and grows dynamic NTK's base, from the longest position of the batch it is called on: a packed
    row's neighbours would change a sample's positions. vLLM decides once per engine: LongRoPE's long factors
    whenever the served length passes ``original_max_position_embeddings`` (the target's own length does), dynamic
    NTK's unscaled base (``max_trained_positions`` = the model's length)."""
    kind = str(emb.rope_type)
    if kind == "longrope":
        original = int(cfg.rope_parameters.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        if cfg.max_position_embeddings > original:
            inv_freq, emb.attention_scaling = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=original + 1)
            emb.inv_freq = inv_freq
    if kind == "longrope" or "dynamic" in kind:
        emb.rope_type = "default"  # transformers' dynamic_rope_update leaves the frequencies alone
    return emb


def num_parameters(model: nn.Module) -> int:
    """Parameters the draft trains and exports (the target's shared embeddings excluded)."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_tokens."))


def attention_window(cfg) -> int:
    """The draft layer's attention window in positions (0: it sees every earlier position)."""
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return int(getattr(cfg, "sliding_window", 0) or 0)
    return 0


def head_dim_of(cfg: LlamaConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class DraftAttention(nn.Module):
    """Multi-head attention over a 2H input with an explicit TTT key cache.

    The cache (``past`` plus this step's pair) is a sequence of (k, v) pairs: entry 0 holds the
    step-0 keys of every position ([B, kvh, T, d], attended through ``mask``), entries 1..k hold
    one key per chain ([B, kvh, T, d], chain t attends only to its own entry t).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        h = cfg.hidden_size
        self.q_proj = nn.Linear(2 * h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.chunk_tokens = int(getattr(cfg, "attn_chunk_tokens", 2048) or 2048)
        self.window = attention_window(cfg)
        self.rotary_dim = rotary_dim(cfg)
        #: Chunked path: a query chunk attends only from the first step-0 key any of its queries
        #: can see (its documents' starts, the window), not from position 0: linear cost in the row
        #: for packed short documents or a window. False: every chunk from 0 (the bench's baseline).
        self.skip_masked_keys = True

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: tuple[tuple[torch.Tensor, torch.Tensor], ...], mask: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns (output, this step's (k, v)); ``past`` holds the earlier steps' (k, v).

        ``mask``: bool [B, T, T] (True where query t may see step-0 key s), or the doc ids
        [B, T] it is built from: then queries are processed in chunks of ``chunk_tokens`` with
        recomputation in backward, so no [T, T] tensor outlives a chunk (long rows).
        Or a :class:`eaglenest.train.context_parallel.SeqShard`: this rank's part of a row split
        over ranks (chunked path at the shard's global positions).
        Pure function of its inputs: FSDP2 may re-wrap the arguments of a sharded block.
        """
        q = self._heads(self.q_proj(x), self.num_heads)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary(q, k, cos, sin, self.rotary_dim)
        # Context parallelism (eaglenest.train.context_parallel): ``mask`` is a SeqShard, the local
        # queries are the row's positions start..start+t, and the step-0 keys/values of the whole
        # row are gathered once (step 0) and kept as the cache's entry 0.
        shard, start = (None, 0) if torch.is_tensor(mask) else (mask, mask.start)
        if shard is not None:
            if not past:
                k, v = shard.gather(k), shard.gather(v)
            mask = shard.doc_ids
        cache = [*past, (k, v)]
        rep = self.num_heads // self.num_kv_heads
        keys = [kk.repeat_interleave(rep, dim=1) for kk, _ in cache]
        vals = [vv.repeat_interleave(rep, dim=1) for _, vv in cache]
        t = q.shape[2]
        if mask.dim() == 3:
            out = self._attend(q, keys, vals, mask)
        elif t <= self.chunk_tokens and shard is None:
            out = self._attend(q, keys, vals, causal_doc_mask(mask, window=self.window))
        else:
            outs = []
            for s in range(0, t, self.chunk_tokens):
                e = min(t, s + self.chunk_tokens)
                # Causal: keys after the chunk's last query are masked anyway, so they are skipped;
                # so are keys before every document and window of the chunk's queries.
                end = start + e
                lo = first_visible_key(mask, start + s, end, window=self.window) if self.skip_masked_keys else 0
                outs.append(checkpoint(self._attend_chunk, q[:, :, s:e], keys[0][:, :, lo:end], vals[0][:, :, lo:end],
                                       [kk[:, :, s:e] for kk in keys[1:]], [vv[:, :, s:e] for vv in vals[1:]],
                                       mask, start + s, lo, use_reentrant=False))
            out = torch.cat(outs, dim=2)
        b, _, tq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, tq, self.num_heads * self.head_dim)), (k, v)

    def _attend_chunk(self, q, k0, v0, dk, dv, doc_ids, start: int, key_start: int = 0) -> torch.Tensor:
        """Queries ``start..start+C`` against step-0 keys ``key_start..start+C``: mask rows built here."""
        mask = chunk_doc_mask(doc_ids, start, start + q.shape[2], window=self.window, key_start=key_start)
        return self._attend(q, [k0, *dk], [v0, *dv], mask)

    def _attend(self, q, keys, vals, mask) -> torch.Tensor:
        """q [B,h,C,d]; keys[0]/vals[0] [B,h,T,d] (step 0), keys[j>0] [B,h,C,d] (per chain)."""
        scale = 1.0 / math.sqrt(self.head_dim)
        # Scores against the step-0 context: [B, h, C, T]; masked entries get -inf. Every query
        # sees at least its own step-0 key (t <= t) or, for k > 0, its diagonal keys, so no row
        # is all -inf (padding rows see themselves).
        s0 = torch.matmul(q, keys[0].transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~mask[:, None], float("-inf"))
        # Scores against the chain's own later steps: one per step, [B, h, C, 1] each.
        sd = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]
        p = torch.softmax(torch.cat([s0, *sd], dim=-1), dim=-1)
        t = s0.shape[-1]
        out = torch.matmul(p[..., :t], vals[0])
        for j, vv in enumerate(vals[1:]):
            out = out + p[..., t + j: t + j + 1] * vv
        return out


class DraftLayer(nn.Module):
    """vLLM's EAGLE-3 first decoder layer (qkv over [embeds ; hidden])."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=eps)
        self.mlp = LlamaMLP(cfg)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))

    def forward(self, embeds, hidden, cos, sin, past, mask):
        """Returns (block output, this step's (k, v)); ``past``: earlier steps' (k, v) pairs."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past, mask)
        residual = residual + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


class DraftHead(nn.Module):
    """What every draft family shares: the head over the draft vocabulary (``lm_head``), the
    draft-to-target id map (``d2t``) and the frozen target embeddings (``embed_tokens``)."""

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings (what a checkpoint stores)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


class Eagle3Draft(DraftHead):
    """The draft model: fc over aux features, one layer, final norm, lm_head over the draft vocab."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        h, th = cfg.hidden_size, cfg.target_hidden_size
        n_aux = len(cfg.eagle_aux_layer_ids)
        eps = cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.input_norm = LlamaRMSNorm(n_aux * th, eps=eps) if cfg.norm_before_fc else None
        self.fc_norm = (nn.ModuleList([LlamaRMSNorm(th, eps=eps) for _ in range(n_aux)])
                        if cfg.fc_norm else None)
        self.fc = nn.Linear(n_aux * th, h, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = rotary_embedding(cfg)
        # Vocabulary maps (see eaglenest.train.vocab); buffers so they travel with state_dict.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # P-EAGLE (eaglenest.train.peagle): the learned aux features of a depth >= 1 slot; vLLM feeds
        # combine(mask_hidden) as the hidden state of every mask-token slot.
        self.mask_hidden = nn.Parameter(torch.zeros(n_aux * th)) if parallel_drafting(cfg) else None

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux*H_target] (aux layers concatenated in ascending id order) -> [..., H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def step(self, token_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
             cache: list, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for all chains. Returns (normed [B,T,H], next hidden [B,T,H])."""
        embeds = self.embed_tokens(token_ids)
        cos, sin = self.rotary_emb(hidden, position_ids)
        # The cache list is extended here, not inside the block: FSDP2 re-wraps a sharded block's
        # arguments, so a list mutated inside it would be a copy.
        res, kv = self.midlayer(embeds, hidden, cos, sin, tuple(cache), mask)
        cache.append(kv)
        normed = self.norm(res)
        return normed, (normed if self.config.norm_output else res)



def parallel_drafting(cfg) -> bool:
    """A P-EAGLE draft (``train.family=peagle``): vLLM drafts all its tokens in one forward."""
    return bool(getattr(cfg, "parallel_drafting", False))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int):
    """Rotate the first ``rot`` dims of each head (neox style), pass the rest through: vLLM's
    ``RotaryEmbedding`` for rotary_dim < head_size. ``rot`` = head_dim is plain Llama."""
    if rot >= q.shape[-1]:
        return apply_rotary_pos_emb(q, k, cos, sin)
    qr, kr = apply_rotary_pos_emb(q[..., :rot], k[..., :rot], cos, sin)
    return torch.cat([qr, q[..., rot:]], dim=-1), torch.cat([kr, k[..., rot:]], dim=-1)


def causal_doc_mask(doc_ids: torch.Tensor, *, window: int = 0) -> torch.Tensor:
    """bool [B, T, T]: query t sees key s iff s <= t and both belong to the same document (and,
    with ``window`` > 0, t - s < window: vLLM's sliding window, the query itself included).

    Padding carries doc id -1: padded queries see earlier padding (harmless, their loss is masked)
    and always their own key, so no softmax row is empty.
    """
    return chunk_doc_mask(doc_ids, 0, doc_ids.shape[1], window=window)


def chunk_doc_mask(doc_ids: torch.Tensor, start: int, end: int, *, window: int = 0, key_start: int = 0) -> torch.Tensor:
    """Rows ``start:end``, columns ``key_start:end`` of :func:`causal_doc_mask` (later keys are all
    False), [B, end-start, end-key_start], without building [T, T]."""
    qi = torch.arange(start, end, device=doc_ids.device)[:, None]
    ki = torch.arange(key_start, end, device=doc_ids.device)[None, :]
    same = doc_ids[:, start:end, None] == doc_ids[:, None, key_start:end]
    seen = (ki <= qi) & same
    if window > 0:
        seen = seen & (qi - ki < window)
    return seen | (ki == qi)


def first_visible_key(doc_ids: torch.Tensor, start: int, end: int, *, window: int = 0) -> int:
    """The lowest key position that any query ``start..end-1`` may see under :func:`causal_doc_mask`:
    a key before it is in none of the chunk's documents (in any row) or outside every query's
    window, so the chunk's scores against it are all masked and can be skipped. Exact for any doc
    ids (not only contiguous documents): the first occurrence of a doc id the chunk holds."""
    lo = max(0, start - window + 1) if window > 0 else 0
    if lo >= start:
        return start
    first = start
    for b in range(doc_ids.shape[0]):
        hit = torch.isin(doc_ids[b, lo:start], doc_ids[b, start:end]).nonzero()
        if hit.numel():
            first = min(first, lo + int(hit[0, 0]))
    return first


def init_weights(model: Eagle3Draft, *, seed: int, std: float = 0.02) -> None:
    """Deterministic init: normal(0, std) linears, ones for norms (embeddings left alone)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("embed_tokens."):
                continue
            if name == "mask_hidden":  # P-EAGLE: random like the linears (zeros would give fc(0) = 0)
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif p.ndim == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


__all__ = ["DraftFlags", "DraftShape", "apply_rotary", "draft_rope", "draft_shape", "num_parameters", "Eagle3Draft", "parallel_drafting", "attention_window", "causal_doc_mask", "chunk_doc_mask", "first_visible_key", "draft_config",
           "init_weights"]
