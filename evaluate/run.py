"""``evaluate al``: serve target + draft with vLLM, decode held-out prompts, report AL per domain.

One engine with the draft decodes each domain in turn (counter deltas give per-domain figures);
optionally a second engine without speculation decodes the same prompts so the report can state
whether speculation was lossless (token-for-token identical greedy output).
"""

from __future__ import annotations

import collections
import json
import logging
import time
from pathlib import Path

from eaglenest.engine import close_llm, make_llm
from eaglenest.errors import EaglenestError, StoreError
from eaglenest.evaluate.al import SpecCounters, read_counters
from eaglenest.featurestore import store

log = logging.getLogger(__name__)


def eval_prompts(store_uri: str, split: str, max_per_domain: int) -> dict[str, list[dict]]:
    """Conversations to decode, grouped by domain, in a stable order."""
    if not store.exists(store_uri, store.PROMPTS):
        raise StoreError(f"no prompts table in {store_uri}: run `ingest build` first")
    rows = store.read(store_uri, store.PROMPTS, columns=["sample_id", "domain", "messages_json"],
                      filter=f"split = '{split}'").to_pylist()
    if not rows:
        raise StoreError(f"no '{split}' prompts in {store_uri}")
    groups: dict[str, list[dict]] = collections.defaultdict(list)
    for r in sorted(rows, key=lambda r: r["sample_id"]):
        msgs = [m for m in json.loads(r["messages_json"]) if m["role"] != "assistant"]
        if max_per_domain <= 0 or len(groups[r["domain"]]) < max_per_domain:
            groups[r["domain"]].append({"sample_id": r["sample_id"], "messages": msgs})
    return dict(sorted(groups.items()))


def _decode(llm, prompts: list[dict], cfg) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=0)
    outs = llm.chat([p["messages"] for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def evaluate_al(*, target: str, draft: str, store_uri: str, cfg) -> dict:
    if not (Path(draft) / "config.json").is_file():
        raise EaglenestError(f"no exported draft at {draft}: run `serve export` first")
    groups = eval_prompts(store_uri, cfg.split, cfg.max_prompts_per_domain)
    t0 = time.time()
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": cfg.num_speculative_tokens}
    llm = make_llm(target, cfg.engine, speculative_config=spec, disable_log_stats=False)
    domains, outputs, total = {}, {}, SpecCounters(0, 0, 0, ())
    try:
        for domain, prompts in groups.items():
            before = read_counters(llm)
            toks = _decode(llm, prompts, cfg)
            delta = read_counters(llm) - before
            total = total + delta
            outputs.update({p["sample_id"]: t for p, t in zip(prompts, toks)})
            domains[domain] = {"prompts": len(prompts), "output_tokens": sum(map(len, toks)), **delta.summary()}
            log.info("%s: AL %.3f over %d prompts", domain, domains[domain]["acceptance_length"] or 0, len(prompts))
    finally:
        close_llm(llm)
    report = {
        "target": target, "draft": draft, "split": cfg.split,
        "num_speculative_tokens": cfg.num_speculative_tokens, "temperature": cfg.temperature,
        "al_average": "pooled over draft rounds: 1 + accepted / rounds",
        "overall": {"prompts": sum(d["prompts"] for d in domains.values()), **total.summary()},
        "domains": domains, "seconds_speculative": round(time.time() - t0, 2),
    }
    if cfg.check_lossless:
        report["lossless"] = _check_lossless(target, groups, outputs, cfg)
    return report


def _check_lossless(target: str, groups: dict[str, list[dict]], outputs: dict, cfg) -> dict:
    llm = make_llm(target, cfg.engine)
    try:
        prompts = [p for ps in groups.values() for p in ps]
        base = _decode(llm, prompts, cfg)
    finally:
        close_llm(llm)
    diff = [p["sample_id"] for p, b in zip(prompts, base) if outputs[p["sample_id"]] != b]
    return {"prompts": len(prompts), "identical": len(prompts) - len(diff), "differing_ids": diff[:20],
            "all_identical": not diff}
