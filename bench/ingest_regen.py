"""Regeneration through eaglenest (pool -> LocalBackend -> prompts-table rows) versus a bare
``vllm.LLM.generate`` over the same prompts, on one engine, timed side by side (alternating order).

    .venv/bin/python bench/ingest_regen.py [--prompts 96] [--max-tokens 64] [--repeats 2]

Prints tokens/s of each and the ratio eaglenest / bare (target: >= 0.9).
"""

from __future__ import annotations

import argparse
import dataclasses
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--target", default="assets/tiny-target")
    a = ap.parse_args()

    from vllm import SamplingParams

    from eaglenest.engine import EngineConfig, close_llm, make_llm
    from eaglenest.ingest.backends import LocalBackend
    from eaglenest.ingest.manifest import Generation, load_manifest
    from eaglenest.ingest.pool import load_pool, raw_text
    from eaglenest.ingest.regen import regenerate

    pool = [e for e in load_pool(load_manifest("recipes/manifests/toy.yaml")) if e.split == "train"]
    entries = [dataclasses.replace(e, mode="raw") for e in pool[: a.prompts]]
    texts = [raw_text(e) for e in entries]
    gen = Generation(max_tokens=a.max_tokens)
    # ignore_eos so both sides generate exactly the same number of tokens
    llm = make_llm(a.target, EngineConfig(max_model_len=1024, max_num_seqs=64))
    backend = LocalBackend(llm)
    backend._params = lambda g: SamplingParams(temperature=0.0, max_tokens=g.max_tokens, ignore_eos=True)
    params = backend._params(gen)
    llm.generate(texts[:4], params, use_tqdm=False)  # warm-up
    res = {"bare": [], "eaglenest": []}
    for r in range(a.repeats):
        for name in (["bare", "eaglenest"] if r % 2 == 0 else ["eaglenest", "bare"]):
            t0 = time.perf_counter()
            if name == "bare":
                n = sum(len(o.outputs[0].token_ids) for o in llm.generate(texts, params, use_tqdm=False))
            else:
                rows, _ = regenerate(backend, entries, gen, "bench")
                n = sum(len(x["response_token_ids"]) for x in rows)
            res[name].append(n / (time.perf_counter() - t0))
    close_llm(llm)
    bare, ours = max(res["bare"]), max(res["eaglenest"])
    print(f"prompts={len(texts)} max_tokens={a.max_tokens} repeats={a.repeats}")
    print(f"bare LLM.generate: {bare:.1f} tok/s   eaglenest regenerate: {ours:.1f} tok/s")
    print(f"ratio eaglenest/bare = {ours / bare:.3f}")


if __name__ == "__main__":
    main()
