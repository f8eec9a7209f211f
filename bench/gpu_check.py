"""GPU check: bf16 trainer throughput and MFU, FSDP2 on NCCL, the offline AL estimator, one JSON.

Written for a bare GPU machine that has only torch, transformers, safetensors, pyarrow and numpy
(no vLLM, no Lance, no tqdm or pyyaml guarantee, no network, eaglenest not installed). It imports
only the eaglenest modules that need nothing else (``train.model``, ``train.ttt``, ``train.dist``,
``train.checkpoint``, ``evaluate.offline``; never ``train.config``/``train.loop``, which import
pyyaml and tqdm), and maps the stage folders to ``eaglenest.*`` itself (:func:`install_shim`), so
it runs from a plain checkout: ``bash bench/gpu_check.sh`` (``--dry-run``: the same code paths at
tiny shapes on CPU with gloo, in seconds; tests/bench/test_gpu_check.py runs it with vllm and lance
unimportable, tqdm and yaml refused to eaglenest and this script, and no installed eaglenest).

Sections, each timed and reported separately (a failing one does not stop the others):

* ``fsdp2``: a 1-rank process group (NCCL; gloo in the dry run) from a ``file://`` rendezvous,
  the TTT objective under FSDP2 as ``train launch`` shards it (``fully_shard`` on the block, then
  the root; bf16 params and fp32 gradient reduction on CUDA), a few steps on one fixed batch with
  the chunked target distribution and loss; losses against the same draft trained without FSDP in
  fp32 (within bf16 rounding on CUDA; equal in the fp32 dry run).
* ``trainer_bf16``: the trainer's step (target distribution, TTT loss, backward, grad clip, AdamW)
  under the same FSDP2 bf16 policy at a realistic draft shape (hidden 4096, MLP 14336, 32/8 heads,
  target vocab 128256, draft vocab 32000, 4096 tokens per step, TTT 7, synthetic features), with
  ``train.target_chunk_tokens`` = 2048 (the default) and = 0 (plain) side by side: tokens/s, MFU,
  ``torch.cuda.max_memory_allocated``.
* ``offline_al``: ``eaglenest.evaluate.offline.offline_al`` on a tiny random Llama and a random
  draft built here (CPU); its outputs must equal the target's own greedy decoding.

MFU = model FLOPs per step / step seconds / peak. Model FLOPs per step (T tokens, K TTT steps):
``K * (6 * (P_layer + P_lm_head) * T + 3 * 2 * T^2 * n_heads * head_dim) + 6 * P_fc * T
+ 2 * T * H * V_target``: forward + backward of the draft block and its lm_head per TTT step,
causal attention scores and values (half of T x T, x3 for backward), the fc once per step, and
the frozen target head's forward. Recomputation (chunked attention in backward) is not counted.
Peak: 989 TFLOPS, the dense BF16 tensor-core peak of an H100/H200 SXM (``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: pyproject.toml's [tool.setuptools.package-dir], used when tomllib cannot read it.
PACKAGE_DIRS = {"eaglenest": "common", "eaglenest.ingest": "ingest", "eaglenest.featurestore": "featurestore",
                "eaglenest.train": "train", "eaglenest.serve": "serve", "eaglenest.evaluate": "evaluate",
                "eaglenest.tinytarget": "tinytarget", "eaglenest.pipeline": "pipeline"}
DEFAULT_CHUNK = 2048  # train.target_chunk_tokens' default (train/config.py imports pyyaml, so not read here)
H200_BF16_TFLOPS = 989.0
#: ``chunk``: train.target_chunk_tokens of the chunked variant (the plain one is 0).
REAL = dict(hidden=4096, inter=14336, heads=32, kv=8, vocab=128256, draft_vocab=32000, tokens=4096, ttt=7,
            warmup=3, steps=10, chunk=DEFAULT_CHUNK)
TINY = dict(hidden=64, inter=128, heads=4, kv=2, vocab=1024, draft_vocab=128, tokens=256, ttt=3, warmup=1, steps=2,
            chunk=64)


def install_shim(root: Path = ROOT) -> None:
    """Make ``eaglenest.*`` importable from the stage folders without installing the package."""
    if "eaglenest" in sys.modules:
        return
    dirs = PACKAGE_DIRS
    try:
        import tomllib

        dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (ImportError, OSError, KeyError):
        pass
    for name in sorted(dirs, key=lambda n: n.count(".")):  # the parent package first
        folder = root / dirs[name]
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if "." in name:
            setattr(sys.modules["eaglenest"], name.rsplit(".", 1)[1], module)


def make_draft(shape: dict, *, seed: int, attn_chunk: int = 2048):
    """A random draft of ``shape`` (target embeddings random too) and its draft-vocab target ids."""
    import torch

    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights

    tcfg = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], rms_norm_eps=1e-5,
                max_position_embeddings=max(8192, shape["tokens"]), hidden_act="silu", rope_theta=500000.0)
    cfg = draft_config(tcfg, draft_vocab_size=shape["draft_vocab"], layer_ids=(2, 4, 6), flags=DraftFlags())
    cfg.attn_chunk_tokens = attn_chunk
    model = Eagle3Draft(cfg)
    init_weights(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(shape["vocab"], generator=g)[:shape["draft_vocab"]]).values
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1, generator=g)
        model.d2t.copy_(ids - torch.arange(ids.numel()))
        model.t2d[ids] = True
    return model, ids


def make_inputs(shape: dict, device, *, seed: int):
    """(TargetHead, Batch): one row of ``tokens`` synthetic tokens, one document, all loss tokens."""
    import torch

    from eaglenest.train.ttt import Batch, TargetHead

    g = torch.Generator().manual_seed(seed + 1)
    h, t = shape["hidden"], shape["tokens"]
    head = TargetHead(torch.ones(h), torch.randn(shape["vocab"], h, generator=g) * 0.5, 1e-5).to(device)
    batch = Batch(input_ids=torch.randint(0, shape["vocab"], (1, t), generator=g),
                  loss_mask=torch.ones(1, t, dtype=torch.bool), doc_ids=torch.zeros(1, t, dtype=torch.long),
                  position_ids=torch.arange(t)[None], aux=torch.randn(1, t, 3 * h, generator=g),
                  last_hidden=torch.randn(1, t, h, generator=g))
    return head, Batch(**{k: v.to(device) for k, v in vars(batch).items()})


def train_step(objective, head, ids, batch, opt, params, *, ttt: int, chunk: int, dist) -> float:
    """One step as train/loop.py takes it (target distribution, global counts, loss, clip, AdamW)."""
    import torch

    from eaglenest.train.ttt import target_targets, valid_counts

    probs, argmax = target_targets(head, batch.last_hidden, ids, chunk_tokens=chunk)
    denoms = dist.all_reduce_sum(valid_counts(batch, ttt))
    res = objective(batch, probs, argmax, num_steps=ttt, step_decay=0.8, denominators=denoms, chunk_tokens=chunk)
    opt.zero_grad(set_to_none=True)
    (res.loss * dist.world_size).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(res.loss.detach())


def _sharded(dist, shape, device, *, seed: int, attn_chunk: int = 2048):
    import torch

    from eaglenest.train.ttt import TTTObjective

    model, ids = make_draft(shape, seed=seed, attn_chunk=attn_chunk)
    objective = dist.shard(TTTObjective(model).to(device), param_dtype="bfloat16")
    params = [p for p in objective.parameters() if p.requires_grad]
    return objective, ids.to(device), params, torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95))


def check_fsdp2(dist, device, *, steps: int = 5) -> dict:
    """FSDP2 (1 rank) against the unsharded fp32 draft: same init, same fixed batch, same steps."""
    import torch

    from eaglenest.train.ttt import TTTObjective

    shape = dict(TINY, hidden=256, inter=512, vocab=8192, draft_vocab=1024, tokens=512) if device.type == "cuda" else TINY
    chunk = shape["tokens"] // 4  # the chunked target distribution and loss, under FSDP2
    head, batch = make_inputs(shape, device, seed=0)
    objective, ids, params, opt = _sharded(dist, shape, device, seed=0)
    fsdp = [train_step(objective, head, ids, batch, opt, params, ttt=shape["ttt"], chunk=chunk, dist=dist)
            for _ in range(steps)]
    plain_model, _ = make_draft(shape, seed=0)
    plain = TTTObjective(plain_model).to(device)
    pp = [p for p in plain.parameters() if p.requires_grad]
    popt = torch.optim.AdamW(pp, lr=1e-3, betas=(0.9, 0.95))
    one = type(dist)(device=device)  # no process group: the plain `train run` path
    ref = [train_step(plain, head, ids, batch, popt, pp, ttt=shape["ttt"], chunk=chunk, dist=one) for _ in range(steps)]
    rel = max(abs(a - b) / abs(b) for a, b in zip(fsdp, ref))
    tol = 5e-2 if device.type == "cuda" else 1e-4  # bf16 params vs fp32 on CUDA; fp32 both on CPU
    ok = all(map(math.isfinite, fsdp)) and fsdp[-1] < fsdp[0] and rel <= tol
    return {"ok": bool(ok), "backend": "nccl" if device.type == "cuda" else "gloo", "world_size": dist.world_size,
            "mixed_precision": "bf16 params, fp32 reduce" if device.type == "cuda" else "none (CPU: fp32)",
            "shape": shape, "target_chunk_tokens": chunk, "losses_fsdp2": fsdp, "losses_unsharded_fp32": ref,
            "max_rel_diff": rel, "tolerance": tol}


def model_flops(model, shape: dict) -> float:
    cfg = model.config
    t, k = shape["tokens"], shape["ttt"]
    layer = sum(p.numel() for p in model.midlayer.parameters() if p.dim() == 2)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = 3 * 2 * t * t * cfg.num_attention_heads * head_dim
    return (k * (6 * (layer + model.lm_head.weight.numel()) * t + attn) + 6 * model.fc.weight.numel() * t
            + 2 * t * shape["hidden"] * shape["vocab"])


def check_trainer(dist, device, shape: dict, *, peak_tflops: float) -> dict:
    """Throughput, MFU and peak memory of the trainer's step, chunked (default) and plain."""
    import torch

    cuda = device.type == "cuda"
    head, batch = make_inputs(shape, device, seed=1)
    objective, ids, params, opt = _sharded(dist, shape, device, seed=1)
    flops = model_flops(objective.draft, shape)
    out = {"shape": shape, "model_flops_per_step": flops, "peak_tflops": peak_tflops if cuda else None,
           "trainable_params": sum(p.numel() for p in params), "variants": {}}
    for chunk in (shape["chunk"], 0):
        name = f"target_chunk_tokens={chunk}"
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            losses = [train_step(objective, head, ids, batch, opt, params, ttt=shape["ttt"], chunk=chunk, dist=dist)
                      for _ in range(shape["warmup"])]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses += [train_step(objective, head, ids, batch, opt, params, ttt=shape["ttt"], chunk=chunk, dist=dist)
                       for _ in range(shape["steps"])]
            if cuda:
                torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / shape["steps"]
            out["variants"][name] = {
                "step_seconds": round(dt, 4), "tokens_per_second": round(shape["tokens"] * dist.world_size / dt, 1),
                "mfu": round(flops / dt / (peak_tflops * 1e12), 4) if cuda else None,
                "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "losses": [round(x, 5) for x in losses]}
        except torch.cuda.OutOfMemoryError as e:  # the plain path is the one that may not fit
            out["variants"][name] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
    good = [v for v in out["variants"].values() if "error" not in v]
    out["ok"] = bool(good) and all(all(map(math.isfinite, v["losses"])) for v in good) and \
        "error" not in out["variants"][f"target_chunk_tokens={shape['chunk']}"]
    return out


def _tiny_target(path: Path) -> Path:
    """A 4-layer random Llama (vocab 256) with a word-level tokenizer, saved like a HF checkpoint."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # confident greedy choices: no near-ties between kernels
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    return path


def check_offline(work: Path, *, prompts: int = 3, max_tokens: int = 24) -> dict:
    """offline_al on the tiny fixture; lossless: outputs == the target's greedy decoding."""
    import torch

    from eaglenest.evaluate.offline import load_target, offline_al
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights

    target = _tiny_target(work / "tiny-target")
    model, _, _ = load_target(target)
    layer_ids = (1, 2, 3)
    draft = Eagle3Draft(draft_config(model.config.to_dict(), draft_vocab_size=64, layer_ids=layer_ids,
                                     flags=DraftFlags()))
    init_weights(draft, seed=0)
    ids = torch.arange(3, 67)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        draft.d2t.copy_(ids - torch.arange(64))
        draft.t2d[ids] = True
    ckpt = save_checkpoint(work / "draft", draft, info={"layer_ids": list(layer_ids), "step": 0, "table_version": 0,
                                                         "store_uri": "none", "train_config": {}})
    g = torch.Generator().manual_seed(0)
    group = [{"sample_id": f"p{i}", "prompt_token_ids": torch.randint(3, 256, (12,), generator=g).tolist()}
             for i in range(prompts)]
    res = offline_al(target=target, draft=ckpt, groups={"synthetic": group}, num_speculative_tokens=3,
                     max_tokens=max_tokens, ignore_eos=True)
    lossless = 0
    with torch.no_grad():
        for p in group:
            ref = model.generate(torch.tensor([p["prompt_token_ids"]]), max_new_tokens=max_tokens, do_sample=False,
                                 min_new_tokens=max_tokens, pad_token_id=0)[0, 12:].tolist()
            lossless += ref == res["outputs"][p["sample_id"]]
    row = res["overall"]
    al = row.get("acceptance_length")
    ok = lossless == prompts and al is not None and 1.0 <= al <= 4.0 and row["draft_rounds"] > 0
    return {"ok": bool(ok), "acceptance_length": al, "rounds": row["draft_rounds"],
            "lossless": f"{lossless}/{prompts}", "overall": {k: v for k, v in row.items() if not isinstance(v, list)}}


def _run(name: str, fn, report: dict) -> None:
    t0 = time.perf_counter()
    try:
        report["sections"][name] = fn()
    except Exception as e:  # noqa: BLE001 - one section's failure is reported, the others still run
        report["sections"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc().splitlines()[-8:]}
    report["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({name: {k: report["sections"][name].get(k) for k in ("ok", "seconds", "error")}}),
          file=sys.stderr, flush=True)


def _positive(text: str) -> int:
    """An argparse ``type``: a whole number >= 1 (eaglenest.cli.at_least, which this script may not import
    before its shim maps the stage folders)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes: the same code paths in seconds")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS, help="per-GPU dense bf16 peak")
    ap.add_argument("--steps", type=_positive, default=None, help="timed trainer steps per variant")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default: $OUT)")
    args = ap.parse_args(argv)
    if args.out:  # made before the check runs: a folder that cannot be, found after it, lost the report
        try:
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"--out {args.out}: {exc.strerror}")
    t_start = time.perf_counter()
    install_shim()
    import torch
    import torch.distributed as tdist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from eaglenest.train.dist import DistState

    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    shape = dict(TINY if args.dry_run else REAL)
    if args.steps:
        shape["steps"] = args.steps
    report = {"mode": "dry-run" if args.dry_run else "gpu", "python": platform.python_version(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu", "sections": {}}
    if not cuda:
        torch.set_num_threads(1)  # tiny tensors: more threads only spin on a shared machine
    with tempfile.TemporaryDirectory(prefix="eaglenest-gpu-check-") as work:
        work = Path(work)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        tdist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{work / 'rendezvous'}",
                                 rank=0, world_size=1)
        dist = DistState(device=device, mesh=init_device_mesh(device.type, (1,), mesh_dim_names=("dp",)))
        try:
            _run("fsdp2", lambda: check_fsdp2(dist, device), report)
            _run("trainer_bf16", lambda: check_trainer(dist, device, shape, peak_tflops=args.peak_tflops), report)
        finally:
            dist.close()
        _run("offline_al", lambda: check_offline(work), report)
    report["ok"] = all(s.get("ok") for s in report["sections"].values())
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(report, indent=2, default=str)
    if args.out:  # under a temporary name, then renamed: a run killed while writing leaves no half file
        tmp = Path(args.out) / f".gpu_check.json.{os.getpid()}.tmp"
        tmp.write_text(text + "\n")
        os.replace(tmp, Path(args.out) / "gpu_check.json")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
