"""The capture fast path against its references: the connector's numpy gather against vLLM's
``extract_from_kv_cache`` (bit for bit), and ``Capturer.stream`` (a refilled window) against
all sequences sent at once and against a transformers forward, on the real tiny target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_connector_gather_cpu_equals_vllm_extract(dtype, block_size):
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        extract_from_kv_cache,
    )

    from eaglenest.featurestore.capture.connector import gather_cpu

    g = torch.Generator().manual_seed(0)
    # A strided view, as vLLM hands the buffer out: [blocks, layers, block_size, hidden] of a larger one.
    raw = torch.randn(40, 4, block_size, 24, generator=g).to(dtype)
    kv = raw[:, :, :, 4:20]
    for num_tokens in (1, block_size, 3 * block_size + 1, 5 * block_size):
        n_blocks = -(-num_tokens // block_size)
        block_ids = torch.randperm(40, generator=g)[:n_blocks].tolist()
        slots = (torch.tensor(block_ids)[:, None] * block_size + torch.arange(block_size)[None, :]).flatten()
        want = extract_from_kv_cache(kv, slots, num_tokens)
        got = gather_cpu(kv, block_ids, num_tokens)
        assert got.dtype == dtype and got.shape == (num_tokens, 4, 16) and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))  # bit for bit
        raw.add_(1)  # the buffer is reused: the gathered copy must not change with it
        assert not torch.equal(got, extract_from_kv_cache(kv, slots, num_tokens))


@pytest.mark.slow
def test_stream_window_equals_all_at_once_and_transformers(tiny_target):
    from transformers import AutoModelForCausalLM

    from eaglenest.engine import EngineConfig
    from eaglenest.featurestore.capture.engine import Capturer, resolve_layer_ids

    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 2000, size=int(n)).tolist() for n in rng.integers(5, 90, size=12)]
    ids = resolve_layer_ids([], 8)
    engine = EngineConfig(max_model_len=256, max_num_seqs=8, memory_fraction=0.08)
    with Capturer(str(tiny_target), ids, 8, engine) as cap:
        whole = cap.capture(seqs)
        # A window of 3 sequences and a byte budget that admits ~100 tokens at a time (refilled in order).
        per = 4 * 128 * 4
        cap.peak_window = dict.fromkeys(cap.peak_window, 0)
        streamed = list(cap.stream(seqs, max_in_flight=3, budget_bytes=100 * per, bytes_per_token=per))
        # The window's bounds held (no sequence here is over the budget alone), and it did fill.
        assert cap.peak_window["in_engine"] <= 3 and cap.peak_window["sequences"] <= 6
        assert 0 < cap.peak_window["bytes"] <= 100 * per
        assert cap.peak_window["sequences"] >= 2
        assert len(streamed) == len(whole) == len(seqs)
        for (a1, l1), (a2, l2), s in zip(whole, streamed, seqs):
            assert a1.shape == (len(s), 3, 128) and l1.shape == (len(s), 128)
            np.testing.assert_array_equal(a1, a2)
            np.testing.assert_array_equal(l1, l2)
        # Leaving early aborts what is queued; the engine stays usable.
        gen = cap.stream(seqs, max_in_flight=6, budget_bytes=float("inf"), bytes_per_token=0)
        next(gen)
        gen.close()
        again = cap.capture(seqs[:2])
        np.testing.assert_array_equal(again[1][0], whole[1][0])
        assert cap.num_forward_passes >= 2 * len(seqs) + 2

    # The layer-id convention: vLLM id j == transformers output_hidden_states[j] (fp32, ~1e-7).
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    with torch.no_grad():
        for (aux, last), s in zip(streamed[:4], seqs):
            hs = model(torch.tensor([s]), output_hidden_states=True).hidden_states
            for j, layer in enumerate(ids):
                torch.testing.assert_close(torch.from_numpy(aux[:, j]), hs[layer][0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.model.norm(torch.from_numpy(last)), hs[8][0], atol=1e-4, rtol=1e-4)
