"""The draft forward equals an independent step-by-step recomputation built on HF's Llama attention.

vLLM drafts by appending its own guesses as new sequence positions. So TTT step 1 of chain t must
equal a plain causal pass over [step-0 inputs at 0..t ; chain t's step-1 input at t+1], and step 2
must equal the same with one more appended position. The recomputation uses transformers'
``LlamaAttention`` (sdpa, explicit causal mask) with a zero-padded o_proj, not our attention code.
"""

from __future__ import annotations

import copy

import torch
from transformers.models.llama.modeling_llama import LlamaAttention

from eaglenest.train.model import Eagle3Draft, causal_doc_mask, draft_config, init_weights, DraftFlags

H = 32
TARGET_CFG = dict(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=128, vocab_size=50,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def hf_attention(model: Eagle3Draft) -> LlamaAttention:
    """HF attention over a 2H input whose o_proj writes [out ; 0] (2H wide)."""
    cfg = copy.deepcopy(model.config)
    cfg.hidden_size = 2 * H
    cfg.head_dim = model.midlayer.self_attn.head_dim
    cfg._attn_implementation = "sdpa"  # computes in float64 (eager softmaxes in fp32)
    attn = LlamaAttention(cfg, layer_idx=0).double()
    ours = model.midlayer.self_attn
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attn, name).weight.copy_(getattr(ours, name).weight)
        attn.o_proj.weight.zero_()
        attn.o_proj.weight[:H].copy_(ours.o_proj.weight)
    return attn


def sequential(model, attn, tokens, hiddens, positions):
    """One plain causal pass over explicit per-position (token, hidden) inputs -> (normed, res)."""
    layer = model.midlayer
    emb = model.embed_tokens(torch.tensor([tokens]))
    hid = torch.stack(hiddens)[None]
    x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hid)], dim=-1)
    cos, sin = model.rotary_emb(hid, torch.tensor([positions]))
    T = len(tokens)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    out, _ = attn(x, (cos, sin), mask)
    res = hid + out[..., :H]
    res = res + layer.mlp(layer.post_attention_layernorm(res))
    return model.norm(res)[0], res[0]


def test_ttt_steps_equal_appended_positions():
    torch.manual_seed(0)
    cfg = draft_config(TARGET_CFG, draft_vocab_size=30, layer_ids=(1, 2), flags=DraftFlags())
    model = Eagle3Draft(cfg).double()
    init_weights(model, seed=1, std=0.3)
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
    attn = hf_attention(model)
    T = 8
    ids = torch.randint(0, 50, (1, T))
    aux = torch.randn(1, T, 2 * H, dtype=torch.float64)
    g = model.combine(aux)
    cache: list = []
    mask = causal_doc_mask(torch.zeros(1, T, dtype=torch.long))
    pos = torch.arange(T)[None]
    tok = lambda i: int(ids[0, i]) if i < T else 0  # noqa: E731
    outs, hidden = [], g
    for k in range(3):
        tokens = torch.tensor([[tok(t + 1 + k) for t in range(T)]])
        normed, hidden = model.step(tokens, hidden, pos + k, cache, mask)
        outs.append((normed[0], hidden[0]))
    for t in range(T - 1):
        tokens = [tok(s + 1) for s in range(t + 1)]
        hiddens = [g[0, s] for s in range(t + 1)]
        positions = list(range(t + 1))
        for k in range(3):
            n_ref, r_ref = sequential(model, attn, tokens, hiddens, positions)
            torch.testing.assert_close(outs[k][0][t], n_ref[-1], rtol=0, atol=1e-9)
            torch.testing.assert_close(outs[k][1][t], r_ref[-1], rtol=0, atol=1e-9)
            # vLLM appends the draft position: next token x_{t+2+k}, hidden = this step's prenorm.
            tokens.append(tok(t + 2 + k))
            hiddens.append(r_ref[-1])
            positions.append(t + 1 + k)


def test_trainable_state_excludes_embeddings_and_embeddings_frozen():
    cfg = draft_config(TARGET_CFG, draft_vocab_size=30, layer_ids=(1, 2, 3), flags=DraftFlags(fc_norm=True))
    model = Eagle3Draft(cfg)
    names = set(model.trainable_state_dict())
    assert not any(n.startswith("embed_tokens") for n in names)
    assert {"fc.weight", "fc_norm.0.weight", "midlayer.hidden_norm.weight", "d2t", "t2d"} <= names
    assert not model.embed_tokens.weight.requires_grad
    assert model.fc.weight.shape == (H, 3 * H)
    assert model.midlayer.self_attn.q_proj.weight.shape == (H, 2 * H)
