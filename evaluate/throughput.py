"""``evaluate throughput``: tokens/s, speed-up, TTFT and latency across a concurrency sweep.

Two managed vLLM servers (``serve.server``) run side by side with the same settings: ``baseline``
(target alone) and ``speculative`` (target + draft). Both are started and warmed up first, then
driven by an asyncio HTTP client over OpenAI chat completions (streamed, so time to first token is
seen), one at a time: for each concurrency level and each seed the two modes are measured back to
back, alternating which goes first, so slow drifts of a shared machine hit both alike. Every point
uses the same held-out prompts (order shuffled by the seed), greedy decoding and ``ignore_eos``
with a fixed ``max_tokens``, so both modes produce the same number of tokens and only speed differs.

Reported per point: output tokens/s (all tokens / wall time), median TTFT and median end-to-end
latency, as mean, min and max over seeds (the spread). Speed-up = speculative / baseline tokens/s,
as the ratio of the means and, per seed (each pair measured back to back), median [min, max].
The idle server only waits on its socket; both hold their KV cache for the whole run. After the
sweep each server's own counters (``/metrics``) are read: the baseline must have drafted nothing and
the speculative one must have drafted (else the run fails), and whether both arms produced the same
text for every prompt is reported (``arms``).
On a 2-core CPU the numbers show the method, not the speed a GPU gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import statistics
import time

from eaglenest.errors import EaglenestError
from eaglenest.evaluate.prompts import check_prompt_lengths, load_prompt_set
from eaglenest.evaluate.plan import max_positions
from eaglenest.evaluate.settings import with_draft_k
from eaglenest.hf import load_tokenizer
from eaglenest.serve.server import Server
from eaglenest.serve.target_check import check_served_tokenization

log = logging.getLogger(__name__)


async def _one(client, url: str, prompt: dict, max_tokens: int, seed: int,
               chat_template_kwargs: dict | None = None) -> dict:
    """One streamed request: a chat completion, or a plain completion of a raw held-out prompt's
    ``raw_text`` (a base model has no chat template to render it with)."""
    body = {"model": "target", "max_tokens": max_tokens, "temperature": 0.0,
            "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    raw = "raw_text" in prompt
    body.update({"prompt": prompt["raw_text"]} if raw else {"messages": prompt["messages"]})
    if chat_template_kwargs and not raw:
        body["chat_template_kwargs"] = chat_template_kwargs
    t0 = time.perf_counter()
    ttft, tokens, text = None, 0, []
    async with client.stream("POST", f"{url}/v1/{'completions' if raw else 'chat/completions'}", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            content = choice.get("text") if raw else (choice.get("delta") or {}).get("content")
            if content:
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                text.append(content)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    e2e = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "output_tokens": tokens, "text": "".join(text)}


async def _point(url: str, prompts: list[dict], *, concurrency: int, max_tokens: int, seed: int,
                 chat_template_kwargs: dict | None = None) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)

    async def run(i):
        async with sem:
            return i, await _one(client, url, prompts[i], max_tokens, seed, chat_template_kwargs)

    # trust_env=False: a proxy of the environment (HTTP_PROXY) cannot reach the server on this machine
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        t0 = time.perf_counter()
        done = dict(await asyncio.gather(*(run(i) for i in order)))
        wall = time.perf_counter() - t0
    rows = [done[i] for i in range(len(prompts))]
    toks = sum(r["output_tokens"] for r in rows)
    return {"output_tokens": toks, "wall_s": wall, "output_tokens_per_s": toks / wall,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
            "median_e2e_s": statistics.median(r["e2e_s"] for r in rows),
            "outputs": [r["text"] for r in rows]}  # in the order of ``prompts``, not of sending


def _spread(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "median": round(statistics.median(values), 4), "n": len(values)}


KEYS = ("output_tokens_per_s", "median_ttft_s", "median_e2e_s")


def summarise(points: dict[str, dict[int, list[dict]]]) -> tuple[dict[str, list[dict]], list[dict]]:
    """Rows per mode and speed-ups from raw points ``{mode: {concurrency: [point per seed]}}``.

    Seeds are paired by position: the i-th baseline and speculative point of a concurrency level
    were measured back to back on the same prompt order.
    """
    modes: dict[str, list[dict]] = {}
    for mode, by_c in points.items():
        modes[mode] = []
        for c, runs in by_c.items():
            row = {"concurrency": c, "requests": runs[0]["requests"], "output_tokens": runs[0]["output_tokens"]}
            row.update({key: _spread([r[key] for r in runs]) for key in KEYS})
            row["per_seed_output_tokens_per_s"] = [round(r["output_tokens_per_s"], 3) for r in runs]
            modes[mode].append(row)
    speedup = []
    for b, s in zip(modes["baseline"], modes["speculative"]):
        # A baseline that produced no tokens (a server that reports no usage) has no speed to compare to.
        pairs = [x / y for x, y in zip(s["per_seed_output_tokens_per_s"], b["per_seed_output_tokens_per_s"]) if y]
        base = b["output_tokens_per_s"]["mean"]
        speedup.append({"concurrency": b["concurrency"],
                        "speedup": round(s["output_tokens_per_s"]["mean"] / base, 3) if base else None,
                        "speedup_per_seed": _spread(pairs) if pairs else None})
    return modes, speedup


def sweep(urls: dict[str, str], prompts: list[dict], *, concurrency: tuple[int, ...], seeds: tuple[int, ...],
          max_tokens: int, num_requests: int, chat_template_kwargs: dict | None = None
          ) -> dict[str, dict[int, list[dict]]]:
    """Raw points ``{mode: {concurrency: [point per seed]}}``; the modes alternate at every point."""
    for url in urls.values():  # warm-up
        asyncio.run(_point(url, prompts[:1], concurrency=1, max_tokens=4, seed=0,
                           chat_template_kwargs=chat_template_kwargs))
    points: dict[str, dict[int, list[dict]]] = {mode: {} for mode in urls}
    for c in concurrency:
        n = max(num_requests, c)
        batch = [prompts[i % len(prompts)] for i in range(n)]
        for i, seed in enumerate(seeds):
            order = list(urls) if i % 2 == 0 else list(urls)[::-1]
            for mode in order:
                pt = asyncio.run(_point(urls[mode], batch, concurrency=c, max_tokens=max_tokens, seed=seed,
                                        chat_template_kwargs=chat_template_kwargs))
                points[mode].setdefault(c, []).append({**pt, "requests": n, "seed": seed})
                log.info("concurrency %d seed %d %s: %.1f tok/s", c, seed, mode, pt["output_tokens_per_s"])
    return points


#: vLLM's Prometheus counters read from each server's ``/metrics`` after the sweep (warm-up included).
COUNTERS = {"generation_tokens": "vllm:generation_tokens_total", "drafts": "vllm:spec_decode_num_drafts_total",
            "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


def server_counters(url: str) -> dict[str, float]:
    """The :data:`COUNTERS` of the server at ``url``, summed over label sets (0 where absent: a server
    without speculation exports no ``spec_decode`` series)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=30.0, trust_env=False).text  # never through HTTP_PROXY
    out = dict.fromkeys(COUNTERS, 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


def check_arms(points: dict[str, dict[int, list[dict]]], counters: dict[str, dict[str, float]]) -> dict:
    """What makes the speed-up a speed-up: the baseline server drafted nothing, the speculative one
    drafted and had tokens accepted, and both produced the same text for every prompt at every
    point (greedy; reported, not enforced: batched kernels may flip a near tie). Raises
    :class:`EaglenestError` when an arm did not run in its mode (then the ratio compares nothing)."""
    base, spec = counters["baseline"], counters["speculative"]
    if base["draft_tokens"] or base["drafts"]:
        raise EaglenestError(f"evaluate throughput: the baseline server drafted {base['draft_tokens']:.0f} tokens: "
                             "it must run the target alone, or the speed-up compares speculation with itself")
    if not spec["drafts"]:
        raise EaglenestError("evaluate throughput: the speculative server drafted nothing: the speed-up would "
                             "compare the target with itself")
    compared = identical = 0
    for c, runs in points["baseline"].items():
        for b, s in zip(runs, points["speculative"][c]):
            compared += len(b["outputs"])
            identical += sum(x == y for x, y in zip(b["outputs"], s["outputs"]))
    rounds = spec["drafts"]
    return {"counters": counters, "outputs_compared": compared, "outputs_identical": identical,
            "all_identical": identical == compared,
            "acceptance_length": round(1 + spec["accepted_tokens"] / rounds, 4)}


def run_sweep(*, target: str, draft: str, store_uri: str, cfg, serve_cfg, log_dir,
              trust_remote_code: bool = False) -> dict:
    # Another tokenizer or template than the draft's features were captured with: a warning, as `evaluate al`.
    check_served_tokenization(draft, target, off_policy=False, stage="measuring")
    cfg = with_draft_k(cfg, draft)  # evaluate.num_speculative_tokens null: the draft's recorded default
    groups, info = load_prompt_set(cfg, store_uri)
    # The prompts the sweep sends (each point cycles over them): a prompt it never sends is not checked.
    prompts = [p for ps in groups.values() for p in ps][:max(cfg.throughput_prompts, *cfg.concurrency)]
    # ignore_eos: every request needs room for all its output tokens, or its server answers 400 mid-sweep.
    check_prompt_lengths(load_tokenizer(target, trust_remote_code=trust_remote_code), prompts, cfg.chat_template_kwargs,
                         max_len=cfg.engine.max_model_len, output_tokens=cfg.throughput_max_tokens,
                         max_positions=max_positions(target, trust_remote_code=trust_remote_code))
    with contextlib.ExitStack() as stack:
        urls = {}
        for mode, d in (("baseline", None), ("speculative", draft)):
            server = Server(target, draft=d, num_speculative_tokens=cfg.num_speculative_tokens,
                            memory_fraction=cfg.engine.memory_fraction, max_model_len=cfg.engine.max_model_len,
                            max_num_seqs=max(cfg.engine.max_num_seqs, max(cfg.concurrency)), log_dir=log_dir,
                            trust_remote_code=trust_remote_code)
            urls[mode] = stack.enter_context(server).url
        points = sweep(urls, prompts, concurrency=tuple(cfg.concurrency), seeds=tuple(cfg.throughput_seeds),
                       max_tokens=cfg.throughput_max_tokens, num_requests=cfg.throughput_prompts,
                       chat_template_kwargs=cfg.chat_template_kwargs)
        arms = check_arms(points, {mode: server_counters(url) for mode, url in urls.items()})
    modes, speedup = summarise(points)
    return {"target": target, "draft": draft, "num_speculative_tokens": cfg.num_speculative_tokens,
            "max_tokens": cfg.throughput_max_tokens, "seeds": list(cfg.throughput_seeds),
            "prompts": info, "modes": modes, "speedup": speedup, "arms": arms,
            "spread": "mean, min and max over seeds; TTFT and latency are per-run medians; speed-up per seed "
                      "pairs the two modes measured back to back"}


def markdown(result: dict) -> str:
    lines = [f"# Throughput: {result['draft']}", "",
             f"Target `{result['target']}`, {result['num_speculative_tokens']} speculative tokens, "
             f"{result['max_tokens']} output tokens per request (ignore_eos), seeds {result['seeds']}; "
             f"{result['spread']}.", "",
             "| concurrency | mode | tok/s mean | tok/s min | tok/s max | median TTFT s | median e2e s | "
             "speed-up (means) | speed-up per seed: median [min, max] |",
             "|---|---|---|---|---|---|---|---|---|"]
    if result.get("arms"):
        a = result["arms"]
        lines[4:4] = [f"Servers' own counters: baseline drafted {a['counters']['baseline']['draft_tokens']:.0f} "
                      f"tokens; speculative AL {a['acceptance_length']}; identical outputs "
                      f"{a['outputs_identical']}/{a['outputs_compared']}.", ""]
    speed = {r["concurrency"]: r for r in result["speedup"]}
    for mode, rows in result["modes"].items():
        for r in rows:
            t, sp = r["output_tokens_per_s"], speed[r["concurrency"]]
            per_seed = sp.get("speedup_per_seed")
            mean = "-" if sp["speedup"] is None else f"{sp['speedup']:.2f}"
            ratio = (mean, f"{per_seed['median']:.2f} [{per_seed['min']:.2f}, "
                     f"{per_seed['max']:.2f}]" if per_seed else "-") if mode == "speculative" else ("1.00", "")
            lines.append(f"| {r['concurrency']} | {mode} | {t['mean']:.1f} | {t['min']:.1f} | {t['max']:.1f} | "
                         f"{r['median_ttft_s']['mean']:.3f} | {r['median_e2e_s']['mean']:.3f} | "
                         f"{ratio[0]} | {ratio[1]} |")
    return "\n".join(lines) + "\n"
