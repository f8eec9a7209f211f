"""Learning curves: served AL against optimizer steps and training seconds, per recipe variant.

Every variant trains on the same features (the demo store, built by ``make demo`` or ``ingest build``
+ ``featurestore capture``), is exported the same way, and is served by the same vLLM on the same
held-out prompts by ``evaluate al``. One row per (variant, epochs): steps, training seconds (the
``train run`` process, wall), served AL pooled over the held-out prompts, acceptance by position,
and whether every output was identical to the target alone (lossless).

    python bench/learning_curves.py --epochs 1,2,4,10 \
        --variant default= --variant lm_head=train.init_lm_head=target \
        --variant lm_head+norm=train.init_lm_head=target,train.init_norm=target

A variant is ``name=override[,override...]`` (dotted recipe overrides; empty = the recipe as is).
Results are appended to ``<workdir>/learning_curves.jsonl`` (a re-run skips rows already there) and
printed as a markdown table, with the ratio of each variant's AL to the first variant's at the
same epochs. Outputs go to ``<workdir>/lc_train_*``, ``lc_draft_*`` and ``lc/eval_*`` and are kept
(drafts can be re-evaluated); the commands run are logged in ``<workdir>/lc/log.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def measure(recipe: str, workdir: Path, name: str, overrides: list[str], epochs: int, log: Path) -> dict:
    tag = f"{name}_e{epochs}".replace("+", "_")
    common = ["--recipe", recipe, f"run.workdir={workdir}"]
    train_s = _run([str(BIN / "train"), "run", *common, f"train.num_epochs={epochs}",
                    f"train.output_subdir=lc_train_{tag}", "train.state.resume=never", *overrides], log)
    _run([str(BIN / "serve"), "export", *common, f"serve.checkpoint_subdir=lc_train_{tag}",
          f"serve.draft_subdir=lc_draft_{tag}", *overrides], log)
    out = workdir / "lc" / f"eval_{tag}"
    draft = workdir / f"lc_draft_{tag}"
    _run([str(BIN / "evaluate"), "al", *common, f"evaluate.draft={draft}",
          "--out", str(out), "evaluate.context_buckets=[]", "evaluate.ngram_order=0", *overrides], log)
    report = json.loads((out / "report.json").read_text())
    info = json.loads((workdir / f"lc_train_{tag}" / "checkpoint.json").read_text())
    overall, lossless = report["overall"], report.get("lossless") or {}
    return {"variant": name, "overrides": overrides, "epochs": epochs, "steps": info["step"],
            "train_seconds": round(train_s, 1), "served_al": overall["acceptance_length"],
            "acceptance_by_position": overall["acceptance_by_position"],
            "lossless": f"{lossless.get('identical')}/{lossless.get('prompts')}", "prompts": overall["prompts"]}


def table(rows: list[dict]) -> str:
    base = {r["epochs"]: r["served_al"] for r in rows if r["variant"] == rows[0]["variant"]}
    out = ["| variant | epochs | steps | train s | served AL | vs first | acceptance by position | lossless |",
           "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["variant"], r["epochs"])):
        ratio = r["served_al"] / base[r["epochs"]] if base.get(r["epochs"]) else float("nan")
        acc = " / ".join(f"{a:.3f}" for a in (r["acceptance_by_position"] or []))
        out.append(f"| {r['variant']} | {r['epochs']} | {r['steps']} | {r['train_seconds']} | {r['served_al']:.3f} | "
                   f"{ratio:.3f} | {acc} | {r['lossless']} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/toy.yaml")
    p.add_argument("--workdir", default="runs/toy", help="run directory holding the demo store")
    p.add_argument("--epochs", default="2,10")
    p.add_argument("--variant", action="append", default=[], help="name=override[,override...]")
    args = p.parse_args()
    variants = [(v.split("=", 1)[0], [o for o in v.split("=", 1)[1].split(",") if o]) for v in
                (args.variant or ["default="])]
    workdir = Path(args.workdir).resolve()
    (workdir / "lc").mkdir(parents=True, exist_ok=True)
    results = workdir / "learning_curves.jsonl"
    rows = [json.loads(x) for x in results.read_text().splitlines()] if results.is_file() else []
    log = workdir / "lc" / "log.txt"
    for epochs in [int(e) for e in args.epochs.split(",")]:
        for name, overrides in variants:
            if any(r["variant"] == name and r["epochs"] == epochs and r["overrides"] == overrides for r in rows):
                continue
            row = measure(args.recipe, workdir, name, overrides, epochs, log)
            rows.append(row)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    names = [n for n, _ in variants]
    print(table([r for r in rows if r["variant"] in names]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    raise SystemExit(main())
