"""``evaluate throughput``: tokens/s, speed-up, TTFT and latency across a concurrency sweep.

For each mode (``baseline``: target alone; ``speculative``: target + draft) one managed vLLM
server (``serve.server``) is started with the same settings, warmed up with one request, then
driven by an asyncio HTTP client over OpenAI chat completions (streamed, so time to first token is
seen) at each concurrency level and each seed. Every point uses the same held-out prompts
(order shuffled by the seed), greedy decoding and ``ignore_eos`` with a fixed ``max_tokens``, so
both modes produce the same number of tokens and only the speed differs.

Reported per point: output tokens/s (all tokens / wall time), median TTFT and median end-to-end
latency, as mean, min and max over seeds (the spread). Speed-up = speculative / baseline tokens/s.
On a 2-core CPU the numbers show the method, not the speed a GPU gets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import statistics
import time

log = logging.getLogger(__name__)


async def _one(client, url: str, messages: list[dict], max_tokens: int, seed: int) -> dict:
    body = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "output_tokens": tokens}


async def _point(url: str, prompts: list[dict], *, concurrency: int, max_tokens: int, seed: int) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    order = list(prompts)
    random.Random(seed).shuffle(order)

    async def run(p):
        async with sem:
            return await _one(client, url, p["messages"], max_tokens, seed)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(run(p) for p in order))
        wall = time.perf_counter() - t0
    toks = sum(r["output_tokens"] for r in rows)
    return {"output_tokens": toks, "wall_s": wall, "output_tokens_per_s": toks / wall,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "median_e2e_s": statistics.median(r["e2e_s"] for r in rows)}


def _spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def sweep(url: str, prompts: list[dict], *, concurrency: tuple[int, ...], seeds: tuple[int, ...],
          max_tokens: int, num_requests: int) -> list[dict]:
    """One row per concurrency level, each over all seeds."""
    asyncio.run(_point(url, prompts[:1], concurrency=1, max_tokens=4, seed=0))  # warm-up
    rows = []
    for c in concurrency:
        n = max(num_requests, c)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        runs = [asyncio.run(_point(url, batch, concurrency=c, max_tokens=max_tokens, seed=s)) for s in seeds]
        row = {"concurrency": c, "requests": n}
        for key in ("output_tokens_per_s", "median_ttft_s", "median_e2e_s"):
            row[key] = _spread([r[key] for r in runs])
        row["output_tokens"] = runs[0]["output_tokens"]
        log.info("concurrency %d: %.1f tok/s", c, row["output_tokens_per_s"]["mean"])
        rows.append(row)
    return rows


def run_sweep(*, target: str, draft: str, store_uri: str, cfg, serve_cfg, log_dir) -> dict:
    from eaglenest.evaluate.prompts import load_prompt_set
    from eaglenest.serve.server import Server

    groups, info = load_prompt_set(cfg, store_uri)
    prompts = [p for ps in groups.values() for p in ps]
    modes = {}
    for mode, d in (("baseline", None), ("speculative", draft)):
        server = Server(target, draft=d, num_speculative_tokens=cfg.num_speculative_tokens,
                        memory_fraction=cfg.engine.memory_fraction, max_model_len=cfg.engine.max_model_len,
                        max_num_seqs=max(cfg.engine.max_num_seqs, max(cfg.concurrency)), log_dir=log_dir)
        with server:
            modes[mode] = sweep(server.url, prompts, concurrency=tuple(cfg.concurrency),
                                seeds=tuple(cfg.throughput_seeds), max_tokens=cfg.throughput_max_tokens,
                                num_requests=cfg.throughput_prompts)
    speedup = [{"concurrency": b["concurrency"],
                "speedup": round(s["output_tokens_per_s"]["mean"] / b["output_tokens_per_s"]["mean"], 3)}
               for b, s in zip(modes["baseline"], modes["speculative"])]
    return {"target": target, "draft": draft, "num_speculative_tokens": cfg.num_speculative_tokens,
            "max_tokens": cfg.throughput_max_tokens, "seeds": list(cfg.throughput_seeds),
            "prompts": info, "modes": modes, "speedup": speedup,
            "spread": "mean, min and max over seeds; TTFT and latency are per-run medians"}


def markdown(result: dict) -> str:
    lines = [f"# Throughput: {result['draft']}", "",
             f"Target `{result['target']}`, {result['num_speculative_tokens']} speculative tokens, "
             f"{result['max_tokens']} output tokens per request (ignore_eos), seeds {result['seeds']}; "
             f"{result['spread']}.", "",
             "| concurrency | mode | tok/s mean | tok/s min | tok/s max | median TTFT s | median e2e s | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    speed = {r["concurrency"]: r["speedup"] for r in result["speedup"]}
    for mode, rows in result["modes"].items():
        for r in rows:
            t = r["output_tokens_per_s"]
            lines.append(f"| {r['concurrency']} | {mode} | {t['mean']:.1f} | {t['min']:.1f} | {t['max']:.1f} | "
                         f"{r['median_ttft_s']['mean']:.3f} | {r['median_e2e_s']['mean']:.3f} | "
                         f"{speed[r['concurrency']] if mode == 'speculative' else 1.0:.2f} |")
    return "\n".join(lines) + "\n"
