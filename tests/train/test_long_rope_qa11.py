"""Rotary positions of long rows: the draft's frequencies are a property of the target's config, never of the batch.

Hugging Face's rotary embedding switches LongRoPE (Phi-3 / Phi-4-mini) between its short and long factors, and
grows dynamic NTK's base, from the longest position of the batch it is called on; vLLM picks the factors once per
engine (long whenever the served length passes ``original_max_position_embeddings``, which the target's own
``max_position_embeddings`` does). A packed row's neighbours must not change a sample's positions, and the draft
must train with the frequencies it is served with. The reference is vLLM's formula written out here.
"""

from __future__ import annotations

import math

import pytest
import torch

from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config

HEAD_DIM, ORIGINAL, LONG = 32, 256, 4096
SHORT_F = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG_F = [1.0 + 0.75 * i for i in range(HEAD_DIM // 2)]
BASE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
            rms_norm_eps=1e-6, vocab_size=512)
LONGROPE = dict(BASE, model_type="phi3", max_position_embeddings=LONG, original_max_position_embeddings=ORIGINAL,
                rope_theta=1e4, rope_scaling={"type": "longrope", "short_factor": SHORT_F, "long_factor": LONG_F})
DYNAMIC = dict(BASE, max_position_embeddings=ORIGINAL, rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 4.0})


def vllm_longrope_cos(positions: torch.Tensor, factors: list[float]) -> torch.Tensor:
    """vLLM's Phi3LongRoPEScaledRotaryEmbedding cos (neox layout): 1 / (factor_i * theta^(2i/d)), times
    sqrt(1 + ln(max / original) / ln(original))."""
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float64)
                 * 1e4 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    mscale = math.sqrt(1 + math.log(LONG / ORIGINAL) / math.log(ORIGINAL))
    freqs = positions.double()[:, None] * inv
    return torch.cat([freqs, freqs], dim=-1).cos() * mscale


def cos_of(draft: Eagle3Draft, position_ids: torch.Tensor) -> torch.Tensor:
    cos, _ = draft.rotary_emb(torch.zeros(*position_ids.shape, 128), position_ids)
    return cos


@pytest.mark.parametrize("target", [LONGROPE, DYNAMIC], ids=["longrope", "dynamic"])
def test_a_samples_rotary_does_not_depend_on_what_is_packed_beside_it(target):
    """The same 40-token sample alone in its row, then beside a sample reaching past the original length (in the
    same row, and in another row of the batch): the same cos/sin at its positions."""
    draft = Eagle3Draft(draft_config(target, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags()))
    short = torch.arange(40)
    alone = cos_of(draft, short[None])[0]
    packed = torch.cat([short, torch.arange(2 * ORIGINAL)])[None]
    beside = cos_of(draft, packed)[0, :40]
    other_row = cos_of(draft, torch.stack([torch.cat([short, torch.zeros(2 * ORIGINAL - 40, dtype=torch.long)]),
                                           torch.arange(2 * ORIGINAL)]))[0, :40]
    torch.testing.assert_close(beside, alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(other_row, alone, rtol=0, atol=1e-6)
    again = cos_of(draft, short[None])[0]  # and no state left behind by the long batch
    torch.testing.assert_close(again, alone, rtol=0, atol=1e-6)


def test_longrope_trains_with_the_long_factors_vllm_serves_with():
    """vLLM serves a LongRoPE target whose length passes the original one with the long factors at every position
    (short prompts included): the draft trains with those, at short and long positions alike."""
    draft = Eagle3Draft(draft_config(LONGROPE, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags()))
    for positions in (torch.arange(40), torch.arange(0, 3 * ORIGINAL, 7)):
        got = cos_of(draft, positions[None])[0].double()
        torch.testing.assert_close(got, vllm_longrope_cos(positions, LONG_F), rtol=0, atol=1e-4)  # fp32 angles
        assert not torch.allclose(got, vllm_longrope_cos(positions, SHORT_F), atol=1e-3)  # the factors differ


def test_longrope_within_the_original_length_keeps_the_short_factors():
    """A LongRoPE config whose length does not pass the original one (vLLM: use_long_rope false) has short
    factors only."""
    target = dict(LONGROPE, max_position_embeddings=ORIGINAL)
    draft = Eagle3Draft(draft_config(target, draft_vocab_size=64, layer_ids=(1, 2, 3), flags=DraftFlags()))
    positions = torch.arange(0, ORIGINAL, 5)
    inv = 1.0 / (torch.tensor(SHORT_F, dtype=torch.float64)
                 * 1e4 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    freqs = positions.double()[:, None] * inv
    torch.testing.assert_close(cos_of(draft, positions[None])[0].double(), torch.cat([freqs, freqs], -1).cos(),
                               rtol=0, atol=1e-5)
