"""Starting a vLLM engine on CPU: in this process (``engine.in_process``, CPU's default) vs vLLM's
own EngineCore and worker processes, side by side.

Usage::

    .venv/bin/python bench/engine_start.py [--rounds 3] [--target assets/tiny-target]

Each arm runs in a fresh interpreter that imports eaglenest's engine module and vLLM first (not
timed), then times ``make_llm`` (the engine start), a greedy decode of 8 prompts x 64 tokens, and
``close_llm``. Prints per round each arm's seconds and the ratio own processes / in process, then
the median [min, max] ratio of the start and of start + decode + close, and whether both arms
decoded the same tokens. With its own processes, vLLM spawns two interpreters (EngineCore, then
its worker), each importing torch and vLLM, before the model loads.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

from eaglenest.cli import at_least

# The arm runner the engine benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)

ARM = """
import json, sys, time
from eaglenest.engine import EngineConfig, close_llm, make_llm
import vllm

def main():
    target, in_process = sys.argv[1], sys.argv[2] == "in_process"
    from vllm import SamplingParams
    t0 = time.perf_counter()
    llm = make_llm(target, EngineConfig(max_model_len=512, memory_fraction=0.1, max_num_seqs=8, in_process=in_process))
    t1 = time.perf_counter()
    prompts = [f"item {i}: one two three" for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    t2 = time.perf_counter()
    close_llm(llm)
    t3 = time.perf_counter()
    print("RESULT " + json.dumps({"start": t1 - t0, "decode": t2 - t1, "close": t3 - t2, "total": t3 - t0,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)

if __name__ == "__main__":
    main()
"""
ARMS = ("own_processes", "in_process")


def run_arm(target: str, arm: str) -> dict:
    return arms.run_arm(ARM, target, arm, label=arm)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    args = ap.parse_args()
    args.target = arms.target_path(ap, args.target)
    starts, totals, same = [], [], True
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        res = {a: run_arm(args.target, a) for a in order}
        own, inp = res["own_processes"], res["in_process"]
        same &= own["tokens"] == inp["tokens"]
        starts.append(own["start"] / inp["start"])
        totals.append(own["total"] / inp["total"])
        print(f"round {r}: " + "; ".join(f"{a} start {x['start']:.2f} s, decode {x['decode']:.2f} s, "
                                         f"close {x['close']:.2f} s" for a, x in res.items())
              + f"; own / in process: start {starts[-1]:.2f}, all {totals[-1]:.2f}", flush=True)
    print(f"engine start, own processes / in process: {_spread(starts)}; start + decode + close: {_spread(totals)} "
          f"over {args.rounds} rounds; same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
