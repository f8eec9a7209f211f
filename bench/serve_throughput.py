"""Serving throughput: the demo's draft against no speculation, side by side in one run.

    python bench/serve_throughput.py [--recipe recipes/toy.yaml] [--out DIR] [k=v ...]

The same code as ``evaluate throughput`` (``eaglenest.evaluate.throughput.run_sweep``): two vLLM
OpenAI servers, same settings, one with the draft at ``<workdir>/<serve.draft_subdir>`` (or
``evaluate.draft``); for each concurrency level and seed both are measured back to back, in
alternating order. Prints the speed-up (speculative / baseline output tokens/s) per concurrency as
the ratio of means and as median [min, max] over seeds, and writes throughput.json / .md / .png.
Defaults keep a run on 2 CPU cores under 15 minutes: concurrency 1, 4, 16, 64; 5 seeds; 64 output
tokens; 32 prompts (64 at concurrency 64).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from eaglenest.cli import path_arg
from eaglenest.errors import EaglenestError

DEFAULTS = ["evaluate.concurrency=[1,4,16,64]", "evaluate.throughput_seeds=[0,1,2,3,4]",
            "evaluate.throughput_max_tokens=64", "evaluate.throughput_prompts=32"]


def speedup_lines(speedup: list[dict]) -> list[str]:
    """The speed-up per concurrency level, as ``run_sweep`` reports it. A level whose baseline produced
    no tokens has no speed-up (``None``, as throughput.md shows it): printed as ``-``, not a crash
    after the whole sweep ran."""
    lines = ["speed-up (speculative / baseline output tokens/s) per concurrency, median [min, max] over seeds:"]
    for r in speedup:
        s, mean = r["speedup_per_seed"], r["speedup"]
        seeds = "-" if s is None else f"{s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"
        lines.append(f"  concurrency {r['concurrency']:>3}: {seeds}  (ratio of means "
                     f"{'-' if mean is None else f'{mean:.3f}'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/toy.yaml", help="the recipe (its run.workdir holds the draft)")
    p.add_argument("--out", type=path_arg, default="/tmp/eaglenest-bench-throughput",
                   help="folder for throughput.json/.md/.png and the servers' logs")
    p.add_argument("overrides", nargs="*", help="recipe overrides (section.key=value)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from eaglenest.evaluate.plots import throughput_plot
    from eaglenest.evaluate.settings import draft_dir
    from eaglenest.evaluate.throughput import markdown, run_sweep
    from eaglenest.provenance import write_json_atomic, write_provenance, write_text_atomic
    from eaglenest.recipe import load_recipe

    # Everything a user can get wrong is refused in one line before the two servers start.
    try:
        recipe = load_recipe(a.recipe, DEFAULTS + a.overrides)
    except EaglenestError as exc:
        p.error(str(exc))
    draft = draft_dir(recipe)
    if not Path(draft).is_dir():
        p.error(f"{draft}: no exported draft (run `serve export` first, or set evaluate.draft)")
    out = Path(a.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {out}: {exc.strerror}")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result = run_sweep(target=recipe.run.target, draft=draft, store_uri=recipe.run.store_uri, cfg=recipe.evaluate,
                       serve_cfg=recipe.serve, log_dir=out / "serve")
    result["bench"] = {"wall_s": round(time.perf_counter() - t0, 1), "load_before": load_before,
                       "load_after": os.getloadavg(), "cpu_count": os.cpu_count()}
    write_json_atomic(out / "throughput.json", result)
    write_text_atomic(out / "throughput.md", markdown(result))
    png = throughput_plot(result, out)
    write_provenance(out, config=recipe.to_dict(), argv=sys.argv, inputs={"draft": draft,
                                                                            "target": recipe.run.target})
    print(markdown(result))
    print("\n".join(speedup_lines(result["speedup"])))
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
          f"wall {result['bench']['wall_s']} s; plot {png}")
    print(json.dumps({"out": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
