"""A plain, slow reference of the TTT objective: explicit loops over rows, chains, steps, keys.

No masks, no shifting, no batching tricks: for every chain t and step k it builds the exact list
of keys the drafter would see in vLLM and evaluates one query vector at a time. It reuses the
draft's parameters (linears, norms, MLP, rotary frequencies) but none of its attention code.
"""

from __future__ import annotations

import math

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def _cos_sin(model, pos: int):
    inv = model.rotary_emb.inv_freq.float()
    freqs = pos * inv
    emb = torch.cat([freqs, freqs])
    return emb.cos(), emb.sin()


def _qkv(model, token: int, hidden: torch.Tensor, pos: int):
    """q [h, d], k [kvh, d], v [kvh, d] of one draft input, rotated at ``pos``."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    emb = model.embed_tokens.weight[token]
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)])
    d = attn.head_dim
    q = attn.q_proj(x).view(attn.num_heads, d)
    k = attn.k_proj(x).view(attn.num_kv_heads, d)
    v = attn.v_proj(x).view(attn.num_kv_heads, d)
    cos, sin = _cos_sin(model, pos)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _finish(model, hidden, q, keys, vals):
    """Attention over explicit key/value lists, then residual, MLP, final norm."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    rep = attn.num_heads // attn.num_kv_heads
    heads = []
    for h in range(attn.num_heads):
        scores = torch.stack([q[h] @ k[h // rep] for k in keys]) / math.sqrt(attn.head_dim)
        p = torch.softmax(scores, dim=0)
        heads.append(sum(p[i] * vals[i][h // rep] for i in range(len(vals))))
    res = layer.hidden_norm(hidden) if layer.norm_before_residual else hidden
    res = res + attn.o_proj(torch.cat(heads))
    res = res + layer.mlp(layer.post_attention_layernorm(res))
    normed = model.norm(res)
    return normed, (normed if model.config.norm_output else res)


def reference_ttt(model, head, rows, *, draft_target_ids, num_steps, step_decay):
    """rows: list of documents, each a list of dicts(ids, loss_mask, aux [T,A], last [T,H]).

    A row with several documents is a packed row; documents never see each other. Returns
    (loss, per-step counts, per-step correct).
    """
    ce_sum = [0.0] * num_steps
    count = [0] * num_steps
    correct = [0] * num_steps
    for row in rows:
        for doc in row:
            ids, lm, aux, last = doc["ids"], doc["loss_mask"], doc["aux"], doc["last"]
            T = len(ids)
            tok = lambda i: ids[i] if i < T else 0  # noqa: E731  (beyond the end: never scored)
            # Step-0 keys/values of every position s: hidden fc(aux_s), token x_{s+1}, position s.
            k0, v0 = [], []
            for s in range(T):
                _, k, v = _qkv(model, tok(s + 1), model.combine(aux[s]), s)
                k0.append(k)
                v0.append(v)
            for t in range(T):
                hidden = model.combine(aux[t])
                own_k, own_v = [], []
                for k in range(num_steps):
                    q, kk, vv = _qkv(model, tok(t + 1 + k), hidden, t + k)
                    if k > 0:
                        own_k.append(kk)
                        own_v.append(vv)
                    keys = k0[: t + 1] + own_k
                    vals = v0[: t + 1] + own_v
                    normed, hidden = _finish(model, hidden, q, keys, vals)
                    j = t + 2 + k
                    if j >= T or not lm[j]:
                        continue
                    logits = head(last[t + 1 + k])
                    p = torch.softmax(logits[draft_target_ids], dim=0)
                    logp = torch.log_softmax(model.lm_head(normed), dim=0)
                    ce_sum[k] = ce_sum[k] + (-(p * logp).sum())
                    count[k] += 1
                    pred = int(draft_target_ids[int(logp.argmax())])
                    correct[k] += int(pred == int(logits.argmax()))
    loss = 0.0
    for k in range(num_steps):
        loss = loss + (step_decay ** k) * ce_sum[k] / max(count[k], 1)
    return loss, count, correct
