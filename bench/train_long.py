"""The trainer's peak memory and tokens/s against tokens per sample, and context parallelism (CP) at the longest.

Each measurement runs in a fresh process (ru_maxrss is a per-process high-water mark), one row of
T tokens per step, exactly the trainer's step (eaglenest.train.loop._Trainer._step without the
loader): target distribution (train.target_chunk_tokens), TTT loss with chunked attention
(train.attn_chunk_tokens), backward, gradient clipping, AdamW. The draft is EAGLE-3 on a target of
the tiny target's shape (hidden 128, 4 heads, draft vocab 1024) unless --hidden says otherwise.

    python bench/train_long.py                                  # 2K/8K/16K/32K, then CP=2 at 32K
    python bench/train_long.py --lengths 2048,4096 --hidden 512 --cp 0   # a wider draft
    python bench/train_long.py --lengths 8192,32768 --doc-tokens 4096 --skip-compare --cp 0   # packed documents
    python bench/train_long.py --lengths 2048 --doc-tokens 128 --ttt-steps 7 --chunk 2048 --chunk-compare 256

``--doc-tokens N`` packs documents of N tokens into each row (positions restart per document, as
the packer does) and ``--window W`` gives the draft a sliding window; ``--skip-compare`` runs each
length twice side by side, the chunked attention from key 0 (``skip_masked_keys`` off) and from
the first key a chunk's documents and window let it see (the default), and prints the ratio;
``--chunk-compare C`` runs each length at ``--chunk`` and at C query tokens per chunk, arms alternated.

Printed per length: peak RSS, its increase over the process before the first step, MiB per 1K
tokens, tokens/s, and the ratios to the shortest length; then a least-squares line of peak RSS
against T (slope = memory per token, R^2 says how linear), and CP=2 against CP=1 at the longest
length (peak RSS per rank, tokens/s of the pair). CP ranks run as a 2-rank gloo group with FSDP2,
as `train launch` runs them; on a 2-core machine the two ranks share the cores, so CP's tokens/s
here says nothing about speed on 2 machines, only its memory does.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from eaglenest.cli import at_least

ROOT = Path(__file__).resolve().parents[1]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(t: int, *, hidden: int, ttt_steps: int, chunk: int, steps: int, cp: int, doc_tokens: int = 0,
            window: int = 0, skip: bool = True) -> dict:
    """One process (or one CP rank under torchrun-style env): ``steps`` trainer steps on a T-token row."""
    import torch

    from eaglenest.train.context_parallel import ContextParallel, CPObjective, real_tokens
    from eaglenest.train.dist import DistState
    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
    from eaglenest.train.ttt import Batch, TargetHead, TTTObjective, target_targets

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    dist = DistState.from_env()
    split = ContextParallel.create(cp, dist)
    vocab, vd, heads = 2048, 1024, max(4, hidden // 128)
    tcfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_attention_heads=heads,
                num_key_value_heads=heads, rms_norm_eps=1e-5, max_position_embeddings=2 * t, hidden_act="silu")
    cfg = draft_config(tcfg, draft_vocab_size=vd, layer_ids=(2, 4, 5), flags=DraftFlags(), sliding_window=window)
    cfg.attn_chunk_tokens = chunk
    model = Eagle3Draft(cfg)
    init_weights(model, seed=0)
    model.midlayer.self_attn.skip_masked_keys = skip
    objective = dist.shard(CPObjective(model) if split else TTTObjective(model), param_dtype="float32")
    g = torch.Generator().manual_seed(0)
    head = TargetHead(torch.ones(hidden), torch.randn(vocab, hidden, generator=g) * 0.05, 1e-5)
    ids = torch.arange(vd) * 2
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    pos = torch.arange(t)[None]
    doc = torch.div(pos, doc_tokens, rounding_mode="floor") if doc_tokens else torch.zeros(1, t, dtype=torch.long)
    row = Batch(input_ids=torch.randint(0, vocab, (1, t), generator=g), loss_mask=torch.ones(1, t, dtype=torch.bool),
                doc_ids=doc, position_ids=pos % doc_tokens if doc_tokens else pos,
                aux=torch.randn(1, t, 3 * hidden, generator=g), last_hidden=torch.randn(1, t, hidden, generator=g))

    saved: dict[int, int] = {}

    def pack(x):  # what autograd keeps for backward, once per storage: the per-token activations
        st = x.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return x

    def step() -> int:
        batch = split.split(row, halo=ttt_steps + 1) if split else row
        probs, argmax = target_targets(head, batch.last_hidden, ids, chunk_tokens=2048)
        denoms = dist.all_reduce_sum(objective.counts(batch, ttt_steps))
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            res = objective(batch, probs, argmax, num_steps=ttt_steps, step_decay=0.8, denominators=denoms,
                            chunk_tokens=2048)
        opt.zero_grad(set_to_none=True)
        (res.loss * dist.world_size).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return real_tokens(batch)

    before = rss_mib()
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens = step()
        seconds.append(time.perf_counter() - t0)
    out = {"tokens": t, "hidden": hidden, "ttt_steps": ttt_steps, "cp": cp, "rank": dist.rank,
           "doc_tokens": doc_tokens, "window": window, "skip_masked_keys": skip,
           "rank_tokens": tokens, "saved_activations_mib": round(sum(saved.values()) / 2**20, 1),
           "peak_rss_mib": round(rss_mib(), 1), "rss_before_mib": round(before, 1),
           "step_seconds": round(min(seconds[1:] or seconds), 6)}  # 2 places read 0.0 for a short row
    dist.close()
    return out


def child(t: int, args, *, cp: int = 1, skip: bool = True, chunk: int = 0) -> list[dict]:
    """``measure`` in fresh processes: one, or ``cp`` ranks of a gloo group (FSDP2, as train launch).
    ``chunk`` overrides ``--chunk``."""
    code = (f"import json,sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import train_long as b; "
            f"print(json.dumps(b.measure({t}, hidden={args.hidden}, ttt_steps={args.ttt_steps}, "
            f"chunk={chunk or args.chunk}, steps={1 if t > 8192 else 2}, cp={cp}, doc_tokens={args.doc_tokens}, "
            f"window={args.window}, skip={skip})))")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "BENCH_THREADS": str(args.threads),
           "PYTHONWARNINGS": "ignore"}
    if cp > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The pair shares this machine's cores: each rank gets its share of the threads.
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(cp), LOCAL_WORLD_SIZE=str(cp),
                   BENCH_THREADS=str(max(1, args.threads // cp)), OMP_NUM_THREADS=str(max(1, args.threads // cp)))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if cp > 1 else {})})
             for r in range(cp)]
    outs = [p.communicate() for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise SystemExit(f"T={t} cp={cp}: {err.strip().splitlines()[-1:]}")
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares y = a + b x: (a, b, R^2)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, 1 - res / ss if ss else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192,16384,32768", help="tokens per sample (one row per step)")
    ap.add_argument("--hidden", type=at_least(1), default=128, help="target/draft hidden size (128 = the tiny target)")
    ap.add_argument("--ttt-steps", type=at_least(1), default=1, help="train.ttt_steps (memory and time grow with it)")
    ap.add_argument("--chunk", type=at_least(1), default=2048, help="train.attn_chunk_tokens")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch threads of each child process")
    ap.add_argument("--cp", type=at_least(0), default=2, help="CP ranks at the longest length (0: skip)")
    ap.add_argument("--doc-tokens", type=at_least(0), default=0, help="documents of this many tokens per row (0: one)")
    ap.add_argument("--window", type=at_least(0), default=0, help="the draft's sliding window (train.sliding_window)")
    ap.add_argument("--skip-compare", action="store_true",
                    help="each length with and without skipping masked keys, side by side")
    ap.add_argument("--chunk-compare", type=at_least(0), default=0, metavar="C",
                    help="each length at --chunk and at C query tokens per chunk, side by side, --rounds times")
    ap.add_argument("--rounds", type=at_least(1), default=2, help="rounds of --chunk-compare (arms alternated)")
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        lengths = [0]
    if min(lengths) < 1:
        ap.error(f"--lengths: a comma list of tokens per sample, each >= 1, got {args.lengths!r}")
    if args.skip_compare:
        return skip_compare(lengths, args)
    if args.chunk_compare:
        return chunk_compare(lengths, args)
    rows = []
    for t in lengths:
        r = child(t, args)[0]
        r["step_rss_mib"] = round(r["peak_rss_mib"] - r["rss_before_mib"], 1)
        r["mib_per_1k_tokens"] = round(r["step_rss_mib"] / t * 1024, 2)
        r["tokens_per_second"] = round(t / r["step_seconds"], 1)
        rows.append(r)
        print(json.dumps(r), flush=True)
    first = rows[0]
    print(f"\nhidden {args.hidden}, TTT steps {args.ttt_steps}, attention chunk {args.chunk}, {args.threads} threads")
    print("| tokens | peak RSS (MiB) | step RSS (MiB) | MiB / 1K tokens | saved for backward (MiB) | tokens/s "
          "| x tokens | x step RSS | x tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['peak_rss_mib']} | {r['step_rss_mib']} | {r['mib_per_1k_tokens']} | "
              f"{r['saved_activations_mib']} | {r['tokens_per_second']} | {r['tokens'] / first['tokens']:.0f} | "
              f"{r['step_rss_mib'] / max(first['step_rss_mib'], 1e-9):.2f} | "
              f"{r['tokens_per_second'] / first['tokens_per_second']:.2f} |")
    if len({r["tokens"] for r in rows}) > 1:  # a line needs two lengths (a length repeated is a repeat, not a fit)
        a, b, r2 = fit([r["tokens"] for r in rows], [r["peak_rss_mib"] for r in rows])
        print(f"\npeak RSS = {a:.0f} MiB + {b * 1024:.1f} MiB per 1K tokens (least squares, R^2 = {r2:.4f})")
    if args.cp > 1:
        t = lengths[-1]
        ranks = child(t, args, cp=args.cp)
        one = rows[-1]
        secs = max(r["step_seconds"] for r in ranks)
        print(json.dumps(ranks))
        print(f"\nCP={args.cp} at {t} tokens: peak RSS per rank {', '.join(str(r['peak_rss_mib']) for r in ranks)} MiB "
              f"(step {', '.join(str(round(r['peak_rss_mib'] - r['rss_before_mib'], 1)) for r in ranks)}) vs "
              f"{one['peak_rss_mib']} (step {one['step_rss_mib']}) on one rank: "
              f"x{max(r['peak_rss_mib'] for r in ranks) / one['peak_rss_mib']:.2f} peak, "
              f"x{max(r['peak_rss_mib'] - r['rss_before_mib'] for r in ranks) / one['step_rss_mib']:.2f} step; "
              f"saved for backward {', '.join(str(r['saved_activations_mib']) for r in ranks)} MiB vs "
              f"{one['saved_activations_mib']}; "
              f"{t / secs:.1f} tokens/s for the pair on the same cores vs {one['tokens_per_second']} "
              f"(rank step seconds {', '.join(str(r['step_seconds']) for r in ranks)})")


def skip_compare(lengths: list[int], args) -> None:
    """Each length: the chunked attention from key 0, then from the first visible key (fresh processes)."""
    print(f"hidden {args.hidden}, TTT steps {args.ttt_steps}, attention chunk {args.chunk}, documents of "
          f"{args.doc_tokens or 'the whole row'} tokens, window {args.window or 'none'}, {args.threads} threads")
    print("| tokens | step s, from key 0 | step s, skipping | speed-up | peak RSS MiB, from key 0 | skipping |")
    print("|---|---|---|---|---|---|")
    for t in lengths:
        (full,), (skip,) = side_by_side(t, args, [{"skip": False}, {"skip": True}], rounds=1)
        print(f"| {t} | {full['step_seconds']} | {skip['step_seconds']} | "
              f"**{full['step_seconds'] / skip['step_seconds']:.2f}x** | {full['peak_rss_mib']} | "
              f"{skip['peak_rss_mib']} |", flush=True)


def chunk_compare(lengths: list[int], args) -> None:
    """Each length at two attention chunk sizes (fresh processes, arms alternated each round): a row no
    longer than one chunk is attended densely, so for rows of short documents the chunk sets the cost."""
    a, b = args.chunk, args.chunk_compare
    print(f"hidden {args.hidden}, TTT steps {args.ttt_steps}, documents of {args.doc_tokens or 'the whole row'} "
          f"tokens, window {args.window or 'none'}, {args.threads} threads, {args.rounds} round(s)")
    print(f"| tokens | step s, chunk {a} | step s, chunk {b} | chunk {a} / chunk {b} (median [min, max]) "
          f"| peak RSS MiB, chunk {a} | chunk {b} |")
    print("|---|---|---|---|---|---|")
    for t in lengths:
        ra, rb = side_by_side(t, args, [{"chunk": a}, {"chunk": b}], rounds=args.rounds)
        sa, sb = [x["step_seconds"] for x in ra], [x["step_seconds"] for x in rb]
        ratios = sorted(x / y for x, y in zip(sa, sb))
        print(f"| {t} | {median(sa):.2f} | {median(sb):.2f} | **{median(ratios):.2f}x** "
              f"[{ratios[0]:.2f}, {ratios[-1]:.2f}] | {max(x['peak_rss_mib'] for x in ra)} | "
              f"{max(x['peak_rss_mib'] for x in rb)} |", flush=True)


def side_by_side(t: int, args, arms: list[dict], *, rounds: int) -> list[list[dict]]:
    """``child`` once per arm (its keyword overrides) for ``rounds`` rounds, the order reversed every
    other round; one list of results per arm."""
    runs: list[list[dict]] = [[] for _ in arms]
    for r in range(rounds):
        for i in (range(len(arms)) if r % 2 == 0 else reversed(range(len(arms)))):
            runs[i].append(child(t, args, **arms[i])[0])
    return runs


if __name__ == "__main__":
    main()
