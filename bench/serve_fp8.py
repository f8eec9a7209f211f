"""FP8 draft export: weight error and acceptance length against the unquantised draft.

    python bench/serve_fp8.py [--workdir runs/toy] [--out DIR] [--served] [--max-prompts-per-domain N]

Exports the demo's draft checkpoint three ways into ``--out``: at the target's dtype (the demo
draft), bf16, and FP8 (``serve.quantization=fp8``). Prints the per-channel weight error of the FP8
linears (max |w - q*s| / amax of the row, against the e4m3 bound 2**-4), then the offline AL
(``evaluate offline``: HF target, PyTorch draft with the FP8 weights dequantised, greedy) of the
three drafts on the same held-out prompts, and with ``--served`` the AL vLLM measures when it
serves each draft (the FP8 one through its own compressed-tensors loader and FP8 kernels), same
prompts, same engine settings. Ratios are FP8 / unquantised. ``results.json`` and its ``provenance.json``
go to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eaglenest.cli import at_least, path_arg
from eaglenest.errors import EaglenestError
from eaglenest.provenance import write_json_atomic, write_provenance


def weight_error(draft_dir: Path, ref_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from eaglenest.serve.fp8 import dequantise

    q, ref = load_file(str(draft_dir / "model.safetensors")), load_file(str(ref_dir / "model.safetensors"))
    rows = {}
    for name, t in q.items():
        if not name.endswith(".weight_scale"):
            continue
        w_name = name[: -len("_scale")]
        w = ref[w_name].float()
        err = (w - dequantise(q[w_name], t)).abs()
        amax = w.abs().amax(dim=1, keepdim=True)
        rows[w_name] = {"max_err_over_row_amax": float((err / amax).max()),
                        "mean_abs_err_over_mean_abs": float(err.mean() / w.abs().mean())}
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/toy", help="run directory holding the demo's checkpoint and store")
    p.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    p.add_argument("--out", type=path_arg, default="/tmp/eaglenest-bench-fp8",
                   help="folder for the three exports and results.json")
    p.add_argument("--max-prompts-per-domain", type=at_least(0), default=0, help="held-out prompts per domain (0: all)")
    p.add_argument("--max-tokens", type=at_least(1), default=160, help="tokens generated per prompt")
    p.add_argument("--served", action="store_true", help="also serve each draft in vLLM and read its AL")
    a = p.parse_args(argv)

    from eaglenest.evaluate.config import EvaluateConfig
    from eaglenest.evaluate.offline import offline_al
    from eaglenest.evaluate.prompts import load_prompt_set
    from eaglenest.serve.export import export_draft

    work, out = Path(a.workdir), Path(a.out)
    # An --out that cannot be written, a missing checkpoint or store: one line, before any AL is measured.
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"--out {out}: {exc.strerror}")
    cfg = EvaluateConfig(max_prompts_per_domain=a.max_prompts_per_domain, max_tokens=a.max_tokens,
                         context_buckets=())
    try:
        drafts = {name: export_draft(work / "train", out / name, target_dir=a.target, dtype=dtype, quantization=q)
                  for name, dtype, q in (("native", "auto", "none"), ("bf16", "bfloat16", "none"),
                                         ("fp8", "auto", "fp8"))}
        groups, info = load_prompt_set(cfg, str(work / "store"))
    except EaglenestError as exc:
        p.error(str(exc))
    errs = weight_error(drafts["fp8"], drafts["native"])
    worst = max(r["max_err_over_row_amax"] for r in errs.values())
    print(f"FP8 linears: {len(errs)}; worst per-channel max|w - q*s| / amax(row) = {worst:.4f} "
          f"(e4m3 bound 2**-4 = {2 ** -4:.4f})")
    for name, r in errs.items():
        print(f"  {name}: max/amax {r['max_err_over_row_amax']:.4f}, mean rel {r['mean_abs_err_over_mean_abs']:.4f}")

    n = sum(len(v) for v in groups.values())
    results = {"prompts": n, "weight_error": errs, "offline": {}, "served": {}}
    for name, d in drafts.items():
        t0 = time.perf_counter()
        rep = offline_al(target=a.target, draft=d, groups=groups, num_speculative_tokens=3, max_tokens=a.max_tokens)
        results["offline"][name] = {"acceptance_length": rep["overall"]["acceptance_length"],
                                    "per_request": rep["overall"]["acceptance_length_per_request"],
                                    "outputs": rep["outputs"]}
        print(f"offline {name}: AL {rep['overall']['acceptance_length']:.4f} over {n} prompts "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if a.served:
        from eaglenest.evaluate.run import evaluate_al

        for name, d in drafts.items():
            rep = evaluate_al(target=a.target, draft=str(d), store_uri=str(work / "store"),
                              cfg=EvaluateConfig(max_prompts_per_domain=a.max_prompts_per_domain,
                                                 max_tokens=a.max_tokens, context_buckets=(),
                                                 check_lossless=(name == "fp8")))
            results["served"][name] = {"acceptance_length": rep["overall"]["acceptance_length"],
                                       "per_request": rep["overall"]["acceptance_length_per_request"],
                                       "lossless": (rep.get("lossless") or {}).get("all_identical")}
            print(f"served {name}: AL {rep['overall']['acceptance_length']:.4f}", flush=True)

    print("\n| draft | offline AL | ratio to native |" + (" served AL | ratio |" if a.served else ""))
    print("|---|---|---|" + ("---|---|" if a.served else ""))
    base = results["offline"]["native"]["acceptance_length"]
    sbase = results["served"].get("native", {}).get("acceptance_length")
    for name in drafts:
        al = results["offline"][name]["acceptance_length"]
        line = f"| {name} | {al:.4f} | {al / base:.4f} |"
        if a.served:
            s = results["served"][name]["acceptance_length"]
            line += f" {s:.4f} | {s / sbase:.4f} |"
        print(line)
    same = sum(results["offline"]["fp8"]["outputs"][k] == v for k, v in results["offline"]["native"]["outputs"].items())
    print(f"offline outputs fp8 == native: {same}/{n} (greedy verification keeps outputs lossless)")
    for r in results["offline"].values():
        r.pop("outputs")
    write_json_atomic(out / "results.json", results)
    # beside the results, as every output has (STYLE.md 12); the exports hold their own (serve export's record)
    write_provenance(out, config={"bench": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}},
                     argv=None if argv is None else [f"bench/{Path(__file__).name}", *argv],
                     inputs={"checkpoint": str(work / "train"), "store": str(work / "store"), "target": a.target,
                             "prompts": n}, extra={"outputs": {"results": "results.json", "drafts": sorted(drafts)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
