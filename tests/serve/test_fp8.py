"""FP8 draft export (``serve.quantization=fp8``): numerics, format, and acceptance length.

* Numerics: per-channel codes and scales are bit-identical to compressed-tensors' own reference
  quantiser, and the dequantised error stays within e4m3's bound.
* Format: config.json's ``quantization_config`` parses in vLLM's ``CompressedTensorsConfig`` as FP8
  per-channel weights with dynamic per-token activations; every scale name maps through vLLM's
  EAGLE-3 weight mapper onto the stacked layer its weight goes to.
* AL, CPU twin: the offline estimator (HF target, PyTorch draft with the FP8 weights dequantised)
  on held-out prompts, FP8 against the unquantised export of the same briefly trained draft.
* AL, GPU (``gpu`` marker, skipped on CPU): vLLM serves the bf16 and the FP8 export (its own FP8
  kernels, W8A8 with per-token activation scales) on the same prompts; the ALs agree within 3%.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.serve import fp8
from eaglenest.serve.export import export_draft

K, MAX_TOKENS = 3, 48


def _weights() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-4, 2, 64)[:, None]
    w[3] = 0.0  # a zero row
    w[5, 1:] *= 1e-4  # one large value, the rest in e4m3's subnormal range after scaling
    return w


def test_quantise_matches_compressed_tensors_and_bound():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = _weights()
    q, s = fp8.quantise_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64, 1)
    args = ct.QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    ref_scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    nonzero = w.abs().amax(1) > 0
    assert torch.equal(ref_scale[nonzero], s[nonzero])
    ref_q = quantize(w, s, torch.zeros_like(s), args, dtype=torch.float8_e4m3fn)
    assert torch.equal(ref_q.view(torch.uint8), q.view(torch.uint8))

    deq = fp8.dequantise(q, s)
    err = (w - deq).abs()
    # e4m3: 3 mantissa bits (relative 2**-4 for normals), subnormal spacing 2**-9 (half: 2**-10).
    assert bool((err <= 2 ** -4 * w.abs() + 2 ** -10 * s + 1e-30).all())
    # Per channel: values in [256, 448] x scale have spacing 32 x scale, so at most amax / 28.
    amax = w.abs().amax(1, keepdim=True)
    assert bool((err.amax(1, keepdim=True) <= amax / 28 * (1 + 1e-6)).all())
    assert bool((q.float().abs().amax(1)[nonzero] == 448).all())  # the row maximum is exact
    assert not bool(deq[3].any()) and bool(torch.isfinite(deq).all())
    q2, s2 = fp8.quantise_per_channel(deq)  # re-quantising a dequantised tensor changes nothing
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory, synth):
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    tmp = tmp_path_factory.mktemp("fp8")
    target = synth.make_target(tmp / "target")
    vocab = select_vocab(torch.randint(0, 100, (2048,)).numpy(), 700)
    model = build_draft(TrainConfig(draft_vocab_size=700), load_target_tensors(target), layer_ids=(2, 4, 5),
                        vocab=vocab, seed=0)
    save_checkpoint(tmp / "ckpt", model, info={"layer_ids": [2, 4, 5], "step": 0, "table_version": 1,
                                               "store_uri": "s", "train_config": {}})
    ref = export_draft(tmp / "ckpt", tmp / "draft", target_dir=target, dtype="bfloat16")
    out = export_draft(tmp / "ckpt", tmp / "draft-fp8", target_dir=target, dtype="bfloat16", quantization="fp8")
    return out, ref, target


def test_fp8_export_format_matches_vllm(fp8_export):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.models.llama_eagle3 import LlamaModel

    out, ref, target = fp8_export
    cfg = json.loads((out / "config.json").read_text())
    qc = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    scheme = qc.target_scheme_map["Linear"]
    assert qc.get_name() == "compressed-tensors" and qc.ignore == ["lm_head"]
    assert CompressedTensorsConfig._is_fp8_w8a8(scheme["weights"], scheme["input_activations"])
    assert scheme["weights"].strategy == "channel" and scheme["input_activations"].dynamic
    assert cfg["torch_dtype"] == "bfloat16"

    tensors, plain = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    scales = sorted(k for k in tensors if k.endswith(".weight_scale"))
    assert {k[: -len(".weight_scale")] for k in scales} == (
        {"fc"} | {f"midlayer.self_attn.{p}_proj" for p in "qkvo"}
        | {f"midlayer.mlp.{p}_proj" for p in ("gate", "up", "down")})
    for k in scales:
        w = k[: -len("_scale")]
        assert tensors[w].dtype == torch.float8_e4m3fn and tensors[k].dtype == torch.float32
        assert tensors[k].shape == (tensors[w].shape[0], 1) and tensors[w].shape == plain[w].shape
        # vLLM loads the scale into the same (stacked) parameter as its weight, e.g. qkv_proj.
        mapped_w, mapped_s = (LlamaModel.hf_to_vllm_mapper._map_name(n) for n in (w, k))
        assert mapped_s == mapped_w + "_scale", (k, mapped_s, mapped_w)
    for k, t in plain.items():  # everything else unchanged: norms, lm_head, d2t, t2d
        if k + "_scale" not in tensors:
            assert torch.equal(tensors[k], t), k
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    # The dequantised draft loads strictly into the PyTorch draft (evaluate offline's loader).
    from eaglenest.evaluate.offline import load_draft

    deq = load_draft(out, target)
    w = deq.state_dict()["midlayer.self_attn.q_proj.weight"]
    assert torch.equal(w, fp8.dequantise(tensors["midlayer.self_attn.q_proj.weight"],
                                          tensors["midlayer.self_attn.q_proj.weight_scale"]))


def test_export_rejects_unknown_quantization(fp8_export, tmp_path):
    from eaglenest.errors import ConfigError

    out, ref, target = fp8_export
    with pytest.raises(ConfigError, match="serve.quantization"):
        export_draft(ref.parent / "ckpt", tmp_path / "x", target_dir=target, quantization="int4")


# --- acceptance length: a briefly trained draft on the committed tiny target -------------------

def _load(rel: str, name: str):
    path = Path(__file__).resolve().parents[2] / rel
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained_exports(tmp_path_factory, root, tiny_target):
    """The offline test's draft (~150 steps on the target's own outputs), exported plain / bf16 / FP8."""
    off = _load("tests/evaluate/test_offline.py", "_eaglenest_test_offline_fp8")
    tmp = tmp_path_factory.mktemp("fp8al")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, ckpt = off._train_draft(tiny_target, off._prompts(root, 0, 8), tmp)
    finally:
        torch.set_num_threads(threads)
    drafts = {name: export_draft(ckpt, tmp / name, target_dir=tiny_target, dtype=dtype, quantization=q)
              for name, dtype, q in (("plain", "auto", "none"), ("bf16", "bfloat16", "none"),
                                     ("fp8", "auto", "fp8"), ("fp8-bf16", "bfloat16", "fp8"))}
    groups = {}
    for p in off._prompts(root, 40, 3):
        groups.setdefault(p["domain"], []).append(p)
    return drafts, groups


@pytest.mark.slow
def test_fp8_offline_al_matches_unquantised(trained_exports, tiny_target):
    """CPU twin of the GPU test: the FP8 numerics, dequantised, against the unquantised draft."""
    from eaglenest.evaluate.offline import offline_al

    drafts, groups = trained_exports
    al = {name: offline_al(target=tiny_target, draft=drafts[name], groups=groups, num_speculative_tokens=K,
                           max_tokens=MAX_TOKENS)["overall"] for name in ("plain", "fp8")}
    print(f"\noffline AL plain {al['plain']['acceptance_length']:.4f} / fp8 {al['fp8']['acceptance_length']:.4f} "
          f"({al['plain']['draft_rounds']} / {al['fp8']['draft_rounds']} rounds)")
    assert al["plain"]["acceptance_length"] > 1.3, "the briefly trained draft should be clearly better than random"
    assert al["fp8"]["acceptance_length"] == pytest.approx(al["plain"]["acceptance_length"], rel=0.03)


def _eval_store(root, tmp: Path) -> str:
    import pyarrow as pa

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    off = _load("tests/evaluate/test_offline.py", "_eaglenest_test_offline_fp8_store")
    uri = str(tmp / "store")
    rows = [dict(sample_id=p["sample_id"], domain=p["domain"], source="test", split="heldout", mode="chat",
                 messages_json=json.dumps(p["messages"]), prompt_token_ids=[], response_token_ids=[],
                 finish_reason="", gen_params_id="g") for p in off._prompts(root, 40, 3)]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


def served_al(target, drafts: dict, store_uri: str, *, dtype: str) -> dict:
    """vLLM's AL (pooled) for each draft directory on the store's held-out prompts, one engine each."""
    from eaglenest.engine import EngineConfig
    from eaglenest.evaluate.config import EvaluateConfig
    from eaglenest.evaluate.run import evaluate_al

    cfg = EvaluateConfig(max_tokens=MAX_TOKENS, num_speculative_tokens=K, context_buckets=(), check_lossless=False,
                         engine=EngineConfig(max_model_len=512, memory_fraction=0.15, dtype=dtype))
    return {name: evaluate_al(target=str(target), draft=str(d), store_uri=store_uri, cfg=cfg)["overall"]
            for name, d in drafts.items()}


@pytest.mark.gpu
@pytest.mark.slow
def test_fp8_served_al_matches_bf16(trained_exports, tiny_target, root, tmp_path):
    """vLLM on a GPU: bf16 target, the bf16 draft against the FP8 draft (FP8 GEMMs, bf16 elsewhere)."""
    drafts, _ = trained_exports
    al = served_al(tiny_target, {"bf16": drafts["bf16"], "fp8": drafts["fp8-bf16"]}, _eval_store(root, tmp_path),
                   dtype="bfloat16")
    print(f"\nserved AL bf16 {al['bf16']['acceptance_length']:.4f} / fp8 {al['fp8']['acceptance_length']:.4f}")
    assert al["bf16"]["acceptance_length"] > 1.3
    assert al["fp8"]["acceptance_length"] == pytest.approx(al["bf16"]["acceptance_length"], rel=0.03)
