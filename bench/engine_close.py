"""Stopping a vLLM engine: ``close_llm``'s 1 s grace (``engine.ENGINE_STOP_GRACE_S``) vs vLLM's
default 5 s, side by side.

Usage::

    .venv/bin/python bench/engine_close.py [--rounds 3] [--target assets/tiny-target]

Each arm runs in a fresh interpreter: start an engine on the target, decode 4 prompts greedily,
then ``close_llm(llm, grace_s=...)``. Prints per round the seconds ``close_llm`` took in each arm,
the seconds until every engine process (EngineCore, its worker) was gone, the ratio default / short,
then the median [min, max] ratio, and whether both arms decoded the same tokens. Every stage that
runs an engine (ingest, capture, evaluation's two passes, the stream producer) closes it this way.
The engines here run in vLLM's own processes (``engine.in_process: false``, CUDA's default); an
engine in the caller's process (CPU's default) has no process to wait for.
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
import psutil
from eaglenest.engine import EngineConfig, close_llm, make_llm

def main():
    target, grace = sys.argv[1], None if sys.argv[2] == "default" else float(sys.argv[2])
    from vllm import SamplingParams
    llm = make_llm(target, EngineConfig(max_model_len=512, memory_fraction=0.1, max_num_seqs=4, in_process=False))
    outs = llm.generate(["one two three", "a b c d", "x", "hello"], SamplingParams(max_tokens=24, temperature=0),
                        use_tqdm=False)
    engine = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
    t0 = time.perf_counter()
    close_llm(llm, grace_s=grace)
    closed = time.perf_counter() - t0
    _, alive = psutil.wait_procs(engine, timeout=60)
    gone = time.perf_counter() - t0
    print("RESULT " + json.dumps({"close": closed, "gone": gone, "engine_processes": len(engine),
                                  "left": len(alive), "tokens": [list(o.outputs[0].token_ids) for o in outs]}),
          flush=True)

if __name__ == "__main__":
    main()
"""


def run_arm(target: str, grace: str) -> dict:
    return arms.run_arm(ARM, target, grace, label=f"grace={grace}")


def main() -> int:
    from eaglenest.engine import ENGINE_STOP_GRACE_S

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    args = ap.parse_args()
    args.target = arms.target_path(ap, args.target)
    short = str(ENGINE_STOP_GRACE_S)
    ratios, same, clean = [], True, True
    for r in range(args.rounds):
        order = ("default", short) if r % 2 == 0 else (short, "default")
        res = {a: run_arm(args.target, a) for a in order}
        same &= res["default"]["tokens"] == res[short]["tokens"]
        clean &= all(x["left"] == 0 and x["engine_processes"] >= 2 for x in res.values())
        ratio = res["default"]["close"] / res[short]["close"]
        ratios.append(ratio)
        print(f"round {r}: close default {res['default']['close']:.2f} s (all gone {res['default']['gone']:.2f}), "
              f"grace {short} s {res[short]['close']:.2f} s (all gone {res[short]['gone']:.2f}), "
              f"default / short {ratio:.2f}", flush=True)
    print(f"close_llm: vLLM's default grace / {short} s grace {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}, {max(ratios):.2f}] over {args.rounds} rounds; same tokens: {same}; "
          f"no engine process left: {clean}")
    return 0 if same and clean else 1


if __name__ == "__main__":
    sys.exit(main())
