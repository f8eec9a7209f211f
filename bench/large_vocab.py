"""Large target vocabularies: peak RSS and tokens/s of the chunked vs the plain target distribution.

Each variant trains a few TTT steps (target distribution, TTT loss, backward, AdamW) on one
packed row of ``--tokens`` random tokens, in a FRESH subprocess, so each peak RSS is that variant's
alone; rounds alternate the order. Printed: per variant, the peak RSS, the RSS before the first
step (draft, head, optimizer, batch), the increase over it, and tokens/s; then the ratios to the
first variant as median [min, max] over rounds.

    # side by side: plain (0) vs chunked (2048, the default), 152K target vocab, 32K draft vocab
    .venv/bin/python bench/large_vocab.py --vocab 152064 --chunks 0,2048 --rounds 2 --steps 1
    # 200K target vocab; TTT 1, where the target distribution sets the peak; chunks of 512
    .venv/bin/python bench/large_vocab.py --vocab 201088 --chunks 0,2048 --rounds 1 --steps 1
    .venv/bin/python bench/large_vocab.py --vocab 201088 --ttt-steps 1 --chunks 0,2048,512 --rounds 1 --steps 1
    # a seconds-long smoke run (equality and memory bounds: tests/train/test_large_vocab.py)
    .venv/bin/python bench/large_vocab.py --tiny

``--chunks`` values are ``train.target_chunk_tokens``: 0 is the plain path (full-vocabulary fp32
logits for the whole row at once, and the plain soft cross-entropy that keeps the fp32
log-softmax and a shifted copy of the target distribution per TTT step). The draft is small
(``--hidden``, default 256) so a step fits 2 CPU cores; the vocab-sized tensors, which are what
chunking changes, have their real sizes ([T, V_target] and [T, Vd]).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eaglenest.cli import at_least

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def one(*, vocab: int, draft_vocab: int, hidden: int, tokens: int, ttt_steps: int, chunk: int,
        steps: int, threads: int, seed: int = 0) -> dict:
    """Run ``steps`` + 1 warm-up training steps of one variant in this process; returns its figures."""
    import torch

    from eaglenest.train.model import DraftFlags, Eagle3Draft, draft_config, init_weights
    from eaglenest.train.ttt import Batch, TargetHead, target_targets, ttt_loss

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    tcfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                num_key_value_heads=4, rms_norm_eps=1e-5, max_position_embeddings=max(8192, tokens),
                hidden_act="silu")
    model = Eagle3Draft(draft_config(tcfg, draft_vocab_size=draft_vocab, layer_ids=(2, 4, 6), flags=DraftFlags()))
    init_weights(model, seed=seed)
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1, generator=g)
        model.d2t.copy_(ids - torch.arange(draft_vocab))
    head = TargetHead(torch.ones(hidden), torch.randn(vocab, hidden, generator=g) * 0.5, 1e-5)
    # One packed row of documents of 256-1024 tokens, every token a loss token.
    lengths, left = [], tokens
    while left > 0:
        lengths.append(min(left, int(torch.randint(256, 1025, (1,), generator=g))))
        left -= lengths[-1]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = Batch(input_ids=torch.randint(0, vocab, (1, tokens), generator=g), loss_mask=torch.ones(1, tokens, dtype=torch.bool),
                  doc_ids=doc, position_ids=pos, aux=torch.randn(1, tokens, 3 * hidden, generator=g),
                  last_hidden=torch.randn(1, tokens, hidden, generator=g))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step() -> float:
        probs, argmax = target_targets(head, batch.last_hidden, ids, chunk_tokens=chunk)
        res = ttt_loss(model, batch, probs, argmax, num_steps=ttt_steps, step_decay=0.8, chunk_tokens=chunk)
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        opt.step()
        return float(res.loss.detach())

    before = _rss_mib()
    losses = [step()]  # warm-up: also allocates AdamW's state
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(step())
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"chunk": chunk, "vocab": vocab, "draft_vocab": draft_vocab, "hidden": hidden, "tokens": tokens,
            "ttt_steps": ttt_steps, "steps": steps, "peak_rss_mib": round(peak, 1),
            "rss_before_mib": round(before, 1), "peak_increase_mib": round(peak - before, 1),
            "tokens_per_second": round(tokens * steps / dt, 1), "losses": [round(x, 5) for x in losses],
            "full_logits_mib": round(tokens * vocab * 4 / 2**20, 1)}


def run_variant(kw: dict) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import large_vocab as b; "
            "print(json.dumps(b.one(**json.loads(sys.argv[2]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench"), json.dumps(kw)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"chunk": kw["chunk"], "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=at_least(1), default=152064, help="target vocabulary (Qwen2.5: 152064)")
    ap.add_argument("--draft-vocab", type=at_least(1), default=32000, help="the draft's vocabulary")
    ap.add_argument("--hidden", type=at_least(1), default=256, help="hidden size")
    ap.add_argument("--tokens", type=at_least(1), default=4096, help="tokens per packed row (one row per step)")
    ap.add_argument("--ttt-steps", type=at_least(1), default=7, help="train.ttt_steps")
    ap.add_argument("--chunks", default="0,2048", help="train.target_chunk_tokens per variant (0 = plain)")
    ap.add_argument("--steps", type=at_least(1), default=2, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--rounds", type=at_least(1), default=2, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--threads", type=at_least(1), default=2, help="torch threads of each variant's process")
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run (vocab 4096, 256 tokens)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.vocab, args.draft_vocab, args.hidden, args.tokens, args.ttt_steps = 4096, 512, 32, 256, 2
        args.chunks, args.steps, args.rounds = "0,64", 1, 1
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        chunks = [-1]
    if min(chunks) < 0:
        ap.error(f"--chunks: a comma list of train.target_chunk_tokens (0 = plain), got {args.chunks!r}")
    base = dict(vocab=args.vocab, draft_vocab=args.draft_vocab, hidden=args.hidden, tokens=args.tokens,
                ttt_steps=args.ttt_steps, steps=args.steps, threads=args.threads)
    rounds: list[dict[int, dict]] = []
    for r in range(args.rounds):
        order = chunks if r % 2 == 0 else chunks[::-1]
        res = {}
        for c in order:
            res[c] = run_variant({**base, "chunk": c})
            print(json.dumps({"round": r, **res[c]}), flush=True)
        rounds.append(res)
    summary: dict = {"config": base, "variants": {}}
    for c in chunks:
        ok = [r[c] for r in rounds if "error" not in r[c]]
        summary["variants"][c] = {
            "runs": len(ok), "errors": [r[c]["error"] for r in rounds if "error" in r[c]],
            **({k: round(statistics.median(x[k] for x in ok), 1) for k in
                ("peak_rss_mib", "rss_before_mib", "peak_increase_mib", "tokens_per_second")} if ok else {})}
    ref = chunks[0]
    for c in chunks[1:]:
        pairs = [(r[ref], r[c]) for r in rounds if "error" not in r[ref] and "error" not in r[c]]
        if pairs:
            summary["variants"][c]["vs_first"] = {
                "peak_rss": _ratio([b["peak_rss_mib"] / a["peak_rss_mib"] for a, b in pairs]),
                "peak_increase": _ratio([b["peak_increase_mib"] / a["peak_increase_mib"] for a, b in pairs]),
                "tokens_per_second": _ratio([b["tokens_per_second"] / a["tokens_per_second"] for a, b in pairs]),
                "first_loss_rel_diff": max(abs(b["losses"][0] - a["losses"][0]) / abs(a["losses"][0])
                                           for a, b in pairs)}
    print(json.dumps(summary, indent=2))
    return 0 if all(not v["errors"] for v in summary["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
