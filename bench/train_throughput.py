"""Trainer throughput: tokens/s and data-stall fraction, fast TTT vs the reference, memory vs length.

Measured side by side in one run; print ratios, not absolute claims (2 shared cores are noisy).

    # CPU: trainer on a real run's store, fast-vs-reference TTT, activation memory vs length
    python bench/train_throughput.py --store runs/toy/store --target assets/tiny-target --steps 20
    python bench/train_throughput.py --long 1024,4096,8192,16384,32768 --long-ttt-steps 2
    # GPU (when one is lent): bf16 FSDP2 tokens/s and model FLOPs utilisation on random batches
    torchrun --nproc-per-node 1 bench/train_throughput.py --gpu --peak-tflops 989

Sections:
* trainer: ``eaglenest.train.loop.train`` for ``--steps`` steps; tokens/s and the share of loop
  time the step waited for the loader thread (the data stall).
* ttt: the fast batched TTT loss + backward against the loop-per-chain reference from
  tests/train/reference_ttt.py on the same random fp32 inputs (same shapes as the tests use).
* long: one TTT forward + backward on a random row of T tokens in a fresh process each: the
  bytes of the tensors autograd saves for backward (activation memory, deduplicated by storage)
  and the peak RSS increase over the process's state before the step (adds transient buffers,
  e.g. one chunk's score matrices; ru_maxrss is a high-water mark, so small T may read ~0).
* gpu (guarded by torch.cuda.is_available()): FSDP2 with bf16 params on random batches;
  MFU = achieved model FLOPs / (--peak-tflops x ranks), model FLOPs = 6 x trainable params x
  tokens x K + attention (the score and value matmuls, causal half, x3 for backward).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "tests" / "train" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_trainer(store: str, target: str, steps: int) -> dict:
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import train

    with tempfile.TemporaryDirectory() as work:
        s = train(TrainConfig(num_steps=steps, log_every_steps=max(1, steps // 4)), store_uri=store,
                  workdir=work, target_dir=target, seed=0)
    return {"steps": s.steps, "tokens_per_second": round(s.tokens_per_second, 1),
            "data_stall_fraction": round(s.stall_fraction, 5)}


def bench_ttt(repeats: int) -> dict:
    from eaglenest.train.ttt import target_targets, ttt_loss

    t, ref = _load("test_ttt"), _load("reference_ttt")
    model, head, ids = t.make_model(3)
    model, head = model.float(), head.float()
    rows = t.make_rows(3, [[24, 16], [32], [20, 12]])
    for doc in (d for r in rows for d in r):
        doc["aux"], doc["last"] = doc["aux"].float(), doc["last"].float()
    batch = t.to_batch(rows)
    batch.aux, batch.last_hidden = batch.aux.float(), batch.last_hidden.float()

    def fast():
        probs, argmax = target_targets(head, batch.last_hidden, ids)
        ttt_loss(model, batch, probs, argmax, num_steps=4, step_decay=0.8).loss.backward()

    def slow():
        ref.reference_ttt(model, head, rows, draft_target_ids=ids, num_steps=4, step_decay=0.8)[0].backward()

    out = {}
    for name, fn in (("fast", fast), ("reference", slow)):
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        out[f"{name}_seconds"] = round((time.perf_counter() - t0) / repeats, 5)
    out["speedup"] = round(out["reference_seconds"] / out["fast_seconds"], 1)
    out["tokens"] = int((batch.doc_ids >= 0).sum())
    return out


def long_one(t: int, k: int, chunk: int) -> dict:
    """One TTT forward+backward on a T-token row (tiny-target shape); run in a fresh process."""
    import torch

    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
    from eaglenest.train.ttt import Batch, ttt_loss

    torch.set_num_threads(2)
    tcfg = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_attention_heads=4,
                num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=65536, hidden_act="silu")
    cfg = draft_config(tcfg, draft_vocab_size=1024, layer_ids=(2, 4, 5), flags=DraftFlags())
    cfg.attn_chunk_tokens = chunk
    model = Eagle3Draft(cfg)
    init_weights(model, seed=0)
    g = torch.Generator().manual_seed(0)
    b = Batch(input_ids=torch.randint(0, 2048, (1, t), generator=g), loss_mask=torch.ones(1, t, dtype=torch.bool),
              doc_ids=torch.zeros(1, t, dtype=torch.long), position_ids=torch.arange(t)[None],
              aux=torch.randn(1, t, 384, generator=g), last_hidden=torch.randn(1, t, 128, generator=g))
    probs = torch.softmax(torch.randn(1, t, 1024, generator=g), -1)
    argmax = torch.randint(0, 2048, (1, t), generator=g)
    saved: dict[int, int] = {}

    def pack(x: torch.Tensor):  # every tensor autograd keeps for backward, once per storage
        st = x.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return x

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = ttt_loss(model, b, probs, argmax, num_steps=k, step_decay=0.8).loss
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": t, "ttt_steps": k, "chunk": chunk, "saved_activations_mib": round(sum(saved.values()) / 2**20, 1),
            "peak_rss_increase_mib": round((peak - before) / 1024, 1), "seconds": round(time.perf_counter() - t0, 2)}


def bench_long(lengths: list[int], k: int, chunk: int) -> list[dict]:
    rows = []
    for t in lengths:
        code = (f"import json,sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import train_throughput as b; "
                f"print(json.dumps(b.long_one({t}, {k}, {chunk})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                    else {"tokens": t, "error": proc.stderr.strip().splitlines()[-1:]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_gpu(steps: int, peak_tflops: float, seq: int, k: int) -> dict:
    """bf16 FSDP2 (torchrun or one process) on random batches of the tiny-target shape x 32."""
    import torch

    from eaglenest.train.dist import DistState
    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
    from eaglenest.train.ttt import Batch, TTTObjective

    dist = DistState.from_env()
    dev = torch.device("cuda", dist.local_rank)
    h, vd = 4096, 32000
    tcfg = dict(vocab_size=128256, hidden_size=h, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=65536, hidden_act="silu")
    cfg = draft_config(tcfg, draft_vocab_size=vd, layer_ids=(2, 16, 29), flags=DraftFlags())
    cfg.attn_chunk_tokens = 4096
    model = Eagle3Draft(cfg)
    init_weights(model, seed=0)
    obj = dist.shard(TTTObjective(model).to(dev), param_dtype="bfloat16")
    params = [p for p in obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator(device=dev).manual_seed(dist.rank)
    b = Batch(input_ids=torch.randint(0, 128256, (1, seq), device=dev, generator=g),
              loss_mask=torch.ones(1, seq, dtype=torch.bool, device=dev),
              doc_ids=torch.zeros(1, seq, dtype=torch.long, device=dev),
              position_ids=torch.arange(seq, device=dev)[None],
              aux=torch.randn(1, seq, 3 * h, device=dev, generator=g),
              last_hidden=torch.randn(1, seq, h, device=dev, generator=g))
    probs = torch.softmax(torch.randn(1, seq, vd, device=dev, generator=g), -1)
    argmax = torch.randint(0, 128256, (1, seq), device=dev, generator=g)

    def step():
        res = obj(b, probs, argmax, num_steps=k, step_decay=0.8)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        opt.step()

    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    attn = 3 * 2 * 2 * seq * seq / 2 * cfg.num_attention_heads * (h // cfg.num_attention_heads)
    flops = (6 * n_params * seq + attn) * k
    out = {"ranks": dist.world_size, "tokens_per_second": round(seq * dist.world_size / dt, 1),
           "mfu": round(flops / dt / (peak_tflops * 1e12), 4), "step_seconds": round(dt, 4),
           "trainable_params": n_params, "seq": seq, "ttt_steps": k,
           "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    dist.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="features store (e.g. <workdir>/store) for the trainer section")
    ap.add_argument("--target", default=str(ROOT / "assets" / "tiny-target"), help="the target model folder")
    ap.add_argument("--steps", type=at_least(1), default=20, help="timed trainer steps")
    ap.add_argument("--ttt-repeats", type=at_least(1), default=5, help="repeats of the fast vs reference TTT timing")
    ap.add_argument("--long", default="", help="comma-separated row lengths for the memory sweep")
    ap.add_argument("--long-ttt-steps", type=at_least(1), default=2, help="train.ttt_steps of the memory sweep")
    ap.add_argument("--chunk", type=at_least(1), default=2048, help="train.attn_chunk_tokens for --long")
    ap.add_argument("--gpu", action="store_true", help="the GPU variant (bf16, FSDP2)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU dense bf16 peak")
    ap.add_argument("--gpu-seq", type=at_least(1), default=4096, help="tokens per row of the GPU variant")
    args = ap.parse_args()
    # Refused before the TTT timing runs, not after it (which lost that section).
    try:
        lengths = [int(x) for x in args.long.split(",") if x]
    except ValueError:
        lengths = [0]
    if lengths and min(lengths) < 1:
        ap.error(f"--long: a comma list of row lengths, each >= 1, got {args.long!r}")
    if args.store and "://" not in args.store and not Path(args.store).is_dir():
        ap.error(f"--store {args.store}: no such store folder")
    import torch  # after parsing: --help stays light

    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device here")
        report["gpu"] = bench_gpu(args.steps, args.peak_tflops, args.gpu_seq, 7)
    else:
        report["ttt"] = bench_ttt(args.ttt_repeats)
        print(json.dumps({"ttt": report["ttt"]}), flush=True)
        if args.store:
            report["trainer"] = bench_trainer(args.store, args.target, args.steps)
        if lengths:
            report["long"] = bench_long(lengths, args.long_ttt_steps, args.chunk)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
