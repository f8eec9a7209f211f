"""vLLM's CPU worker on every core (``engine.cpu_all_cores``) vs vLLM's default (one core left to
the frontend), side by side: a long prefill plus a short greedy decode, the same prompts.

Usage::

    .venv/bin/python bench/cpu_threads.py [--tokens 16384] [--decode 32] [--rounds 3]

Each arm runs in a fresh interpreter (the engine core reads its binding when it is spawned), on the
long-context tiny target (``assets/tiny-target-long``) by default, prefix caching off, one engine
start per arm and round, arms alternating so load hits both alike. Prints per round the seconds of
each arm's requests (engine start not counted) and the ratio default / all-cores, then the median
[min, max] ratio, and whether both arms produced the same tokens (they must: the binding changes
the threads, not the model).
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
import json, random, sys, time
from eaglenest.engine import EngineConfig, close_llm, make_llm

def main():
    target, tokens, decode, all_cores, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = EngineConfig(max_model_len=tokens + decode + 16, cpu_all_cores=all_cores)
    llm = make_llm(target, cfg, enable_prefix_caching=False)
    rng = random.Random(seed)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(100, 1000) for _ in range(tokens)]) for _ in range(2)]
    params = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    close_llm(llm)
    print("RESULT " + json.dumps({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)

if __name__ == "__main__":
    main()
"""


def run_arm(target: str, tokens: int, decode: int, all_cores: bool, seed: int) -> dict:
    return arms.run_arm(ARM, target, str(tokens), str(decode), "1" if all_cores else "0", str(seed),
                        label=f"all_cores={all_cores}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="assets/tiny-target-long", help="the target model folder")
    ap.add_argument("--tokens", type=at_least(1), default=16384, help="prompt tokens (two prompts per arm)")
    ap.add_argument("--decode", type=at_least(1), default=32, help="greedy output tokens per prompt")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    args = ap.parse_args()
    args.target = arms.target_path(ap, args.target)
    ratios, same = [], True
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        res = {a: run_arm(args.target, args.tokens, args.decode, a, seed=r) for a in order}
        same &= res[False]["tokens"] == res[True]["tokens"]
        ratio = res[False]["seconds"] / res[True]["seconds"]
        ratios.append(ratio)
        print(f"round {r}: default {res[False]['seconds']:.1f} s, all cores {res[True]['seconds']:.1f} s, "
              f"default / all cores {ratio:.2f}", flush=True)
    print(f"{args.tokens} prompt tokens + {args.decode} decoded, 2 prompts: default / all cores "
          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] over {args.rounds} rounds; "
          f"same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
