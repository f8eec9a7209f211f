"""Draft families side by side: EAGLE-3, P-EAGLE and DFlash trained from one features table version.

Each family is trained with ``train.family=<family>`` as its only override (its defaults are the
family's own: docs/families.md), for the same number of optimizer steps, exported, and served by
vLLM on the same held-out prompts by the project's own commands (``train run``, ``serve export``,
``evaluate al``, ``evaluate throughput``). Per family:

* a learning curve: served AL at 3 speculative tokens after each of ``--curve`` epochs (a fresh run
  per point, full schedule, through ``bench/learning_curves.py``'s ``measure``);
* a sweep of the number of speculative tokens K on the last draft: served AL, acceptance by
  position, and the n-gram reference (``evaluate``'s ``ngram_al``) replayed at the same K;
* draft forwards per round (K for EAGLE-3; 1 for the parallel families: what
  ``speculative_config`` asks vLLM for) and tokens per second at K=3 and at the family's best K
  (``evaluate throughput``, speculation on and off back to back).

    python bench/families.py --workdir runs/toy               # demo scale: 10 epochs (180 steps)
    python bench/families.py --workdir runs/toy --quick       # smoke run: 1 epoch, K 1 and 3

The store must exist (``make demo``, or ``ingest build`` + ``featurestore capture`` with the same
``run.workdir``). Rows go to ``<workdir>/families.jsonl`` (a re-run skips rows already there of the same
``--recipe`` and overrides), its provenance to ``<workdir>/families.provenance.json``;
outputs to ``<workdir>/lc_*`` and ``<workdir>/fam/`` (folder names end in a hash of the recipe and the
overrides: ``learning_curves.point_tag``); commands are logged in ``<workdir>/lc/log.txt``.
Printed: the tables and the ratios of the issue's goals (P-EAGLE / EAGLE-3 at K=3 and the same
steps; DFlash's best AL / EAGLE-3's best AL).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from eaglenest.cli import at_least

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_curves import (BIN, _run, int_list, load_rows, measure, point_dirs, point_tag,  # noqa: E402
                             recipe_key, row_recipe, run_dir, write_results_provenance)  # (bench/: no package)

FAMILIES = ("eagle3", "peagle", "dflash")
#: The K every family is compared at (the issue's P-EAGLE goal is at 3).
K_REF = 3


def _key(row: dict) -> tuple:
    return row["kind"], row["family"], row.get("epochs"), row.get("k")


def forwards_per_round(draft: Path, k: int) -> int:
    """Draft forwards vLLM runs per round for ``draft`` at K=k: 1 for a parallel draft (P-EAGLE's
    ``parallel_drafting``, DFlash's block), K for EAGLE-3's chain; read off the project's own
    ``speculative_config``, i.e. what vLLM is asked to run."""
    from eaglenest.engine import speculative_config

    spec = speculative_config(str(draft), k)
    return 1 if spec["method"] == "dflash" or spec.get("parallel_drafting") else k


def curve_overrides(args, family: str) -> list[str]:
    return [f"train.family={family}", f"evaluate.num_speculative_tokens={K_REF}",
            f"evaluate.ngram_order={args.ngram_order}", *args.extra]


def curve_point(args, workdir: Path, family: str, epochs: int, log: Path) -> dict:
    row = measure(args.recipe, workdir, family, curve_overrides(args, family), epochs, log, key=list(args.extra))
    dirs = curve_dirs(args, workdir, family, epochs)
    report = json.loads((dirs["eval"] / "report.json").read_text())
    info = json.loads((dirs["train"] / "checkpoint.json").read_text())
    row.update(kind="curve", family=family, k=K_REF, table_version=info.get("table_version"),
               ngram_al=report["overall"].get("ngram_al"),
               forwards_per_round=forwards_per_round(dirs["draft"], K_REF))
    return row


def curve_dirs(args, workdir: Path, family: str, epochs: int) -> dict[str, Path]:
    """The folders of a family's curve point (``learning_curves.point_dirs``), keyed by the recipe and the extra
    overrides as its rows are (the family is in the name; K and the n-gram order only evaluate the draft)."""
    return point_dirs(workdir, args.recipe, family, list(args.extra), epochs)


def fam_dir(args, workdir: Path, kind: str, family: str, epochs: int, k: int) -> Path:
    """``<workdir>/fam/<kind>_<family>_e<epochs>_k<k>_<key>``: keyed by the recipe and the extra overrides
    as the curve points are, so two recipes' sweeps do not overwrite each other's."""
    return workdir / "fam" / f"{kind}_{point_tag(args.recipe, family, list(args.extra), epochs)}_k{k}"


def sweep_point(args, workdir: Path, family: str, epochs: int, k: int, log: Path) -> dict:
    draft = curve_dirs(args, workdir, family, epochs)["draft"]
    out = fam_dir(args, workdir, "sweep", family, epochs, k)
    _run([str(BIN / "evaluate"), "al", "--recipe", args.recipe, f"run.workdir={workdir}", f"evaluate.draft={draft}",
          f"evaluate.num_speculative_tokens={k}", "evaluate.context_buckets=[]", "evaluate.check_lossless=false",
          f"evaluate.ngram_order={args.ngram_order}", "--out", str(out), *args.extra], log)
    o = json.loads((out / "report.json").read_text())["overall"]
    return {"kind": "sweep", "family": family, "epochs": epochs, "k": k, "served_al": o["acceptance_length"],
            "acceptance_by_position": o["acceptance_by_position"], "ngram_al": o.get("ngram_al"),
            "forwards_per_round": forwards_per_round(draft, k)}


def throughput_point(args, workdir: Path, family: str, epochs: int, k: int, log: Path) -> dict:
    draft = curve_dirs(args, workdir, family, epochs)["draft"]
    out = fam_dir(args, workdir, "tput", family, epochs, k)
    _run([str(BIN / "evaluate"), "throughput", "--recipe", args.recipe, f"run.workdir={workdir}",
          f"evaluate.draft={draft}", f"evaluate.num_speculative_tokens={k}", "evaluate.concurrency=[1]",
          "evaluate.throughput_seeds=[0]", f"evaluate.throughput_prompts={args.tput_prompts}",
          "--out", str(out), *args.extra], log)
    res = json.loads((out / "throughput.json").read_text())
    tok_s = {mode: rows[0]["output_tokens_per_s"]["mean"] for mode, rows in res["modes"].items()}
    speedup = res["speedup"][0]["speedup"]  # None where the baseline produced no tokens
    return {"kind": "throughput", "family": family, "epochs": epochs, "k": k,
            "tokens_per_s": round(tok_s["speculative"], 1), "target_alone_tokens_per_s": round(tok_s["baseline"], 1),
            "speedup": None if speedup is None else round(speedup, 3), "identical": res["arms"]["all_identical"]}


def _speedup(row: dict | None) -> str:
    return "-" if row is None or row["speedup"] is None else str(row["speedup"])


def _pos(acc) -> str:
    return " / ".join(f"{a:.2f}" for a in acc or [])


def tables(rows: list[dict], families: list[str], last: int) -> str:
    get = {_key(r): r for r in rows}
    best = {}
    for f in families:
        sw = [r for r in rows if r["kind"] == "sweep" and r["family"] == f and r["epochs"] == last]
        if sw:
            best[f] = max(sw, key=lambda r: r["served_al"])
    out = ["| family | steps | served AL (K=3) | acceptance by position | draft forwards / round | n-gram AL (K=3) "
           "| best K | AL at best K | tok/s K=3 (target alone) | speed-up K=3 | speed-up best K | lossless |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in families:
        c = get.get(("curve", f, last, K_REF))
        if not c:
            continue
        t, b = get.get(("throughput", f, last, K_REF)), best.get(f)
        tb = get.get(("throughput", f, last, b["k"])) if b else None
        tput = f"{t['tokens_per_s']} ({t['target_alone_tokens_per_s']})" if t else "-"
        out.append(f"| {f} | {c['steps']} | {c['served_al']:.3f} | {_pos(c['acceptance_by_position'])} | "
                   f"{c['forwards_per_round']} | {c['ngram_al'] if c.get('ngram_al') is not None else '-'} | "
                   f"{b['k'] if b else '-'} | {b['served_al'] if b else '-'} | {tput} | "
                   f"{_speedup(t)} | {_speedup(tb)} | {c['lossless']} |")
    ks = sorted({r["k"] for r in rows if r["kind"] == "sweep"})
    out += ["", "K sweep (served AL; n-gram AL at the same K in brackets; draft forwards per round after /):", "",
            "| family | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for f in families:
        cells = []
        for k in ks:
            r = get.get(("sweep", f, last, k))
            cells.append(f"{r['served_al']:.3f} ({r['ngram_al']}) /{r['forwards_per_round']}" if r else "-")
        out.append(f"| {f} | " + " | ".join(cells) + " |")
    out += ["", "Acceptance by position at the best K:", ""]
    out += [f"* {f} (K={b['k']}): {_pos(b['acceptance_by_position'])}" for f, b in best.items()]
    curve = sorted({r["epochs"] for r in rows if r["kind"] == "curve"})
    out += ["", "Learning curve (served AL at K=3; steps in brackets):", "",
            "| family | " + " | ".join(f"{e} epochs" for e in curve) + " |", "|---|" + "---|" * len(curve)]
    for f in families:
        cells = [(lambda r: f"{r['served_al']:.3f} ({r['steps']})" if r else "-")(get.get(("curve", f, e, K_REF)))
                 for e in curve]
        out.append(f"| {f} | " + " | ".join(cells) + " |")
    out += ["", *ratios(get, best, last)]
    return "\n".join(out)


def ratios(get: dict, best: dict, last: int) -> list[str]:
    lines = []
    e3, pe = get.get(("curve", "eagle3", last, K_REF)), get.get(("curve", "peagle", last, K_REF))
    if e3 and pe:
        r = pe["served_al"] / e3["served_al"]
        lines.append(f"P-EAGLE / EAGLE-3 served AL at K=3, {pe['steps']} steps: {r:.3f} (goal >= 0.9: "
                     f"{'met' if r >= 0.9 else 'missed'}), draft forwards per round {pe['forwards_per_round']} "
                     f"vs {e3['forwards_per_round']}")
    if "eagle3" in best and "dflash" in best:
        d, e = best["dflash"], best["eagle3"]
        r = d["served_al"] / e["served_al"]
        lines.append(f"DFlash best (K={d['k']}) / EAGLE-3 best (K={e['k']}) served AL: {d['served_al']:.3f} / "
                     f"{e['served_al']:.3f} = {r:.3f} (goal >= 1: {'met' if r >= 1 else 'missed'})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="recipes/toy.yaml", help="the recipe every family starts from")
    p.add_argument("--workdir", default="runs/toy", help="run directory holding the demo store")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list of the families compared")
    p.add_argument("--epochs", type=at_least(1), default=10,
                   help="the compared drafts' epochs (10 = the demo, 180 steps)")
    p.add_argument("--curve", type=int_list(1, empty=True), default="4",
                   help="more epochs for the learning curves (comma list, '' = none)")
    p.add_argument("--ks", type=int_list(1, empty=True), default="2,4,6",
                   help="numbers of speculative tokens swept on the last draft (3 always)")
    p.add_argument("--tput-prompts", type=at_least(1), default=8, help="requests per throughput measurement")
    p.add_argument("--no-throughput", action="store_true", help="skip the tokens/s measurements")
    p.add_argument("--tput-ks", type=int_list(1, empty=True), default="",
                   help="K values for tokens/s (default: 3 and the best-AL K)")
    p.add_argument("--ngram-order", type=at_least(0), default=3, help="evaluate.ngram_order of the n-gram baseline")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 epoch, no curve, K 1 and 3, 4 requests")
    p.add_argument("extra", nargs="*", help="more recipe overrides for every command (key=value)")
    args = p.parse_args()
    if args.quick:
        args.epochs, args.curve, args.ks, args.tput_prompts = 1, [], [1], 4
    families = [f for f in args.families.split(",") if f]
    if unknown := set(families) - set(FAMILIES):
        p.error(f"--families: unknown {sorted(unknown)}; one or more of {', '.join(FAMILIES)}")
    ks, curve = args.ks, args.curve
    workdir = run_dir(p, args.workdir)
    (workdir / "lc").mkdir(exist_ok=True)
    (workdir / "fam").mkdir(exist_ok=True)
    results = workdir / "families.jsonl"
    recipe = recipe_key(args.recipe)
    # This run's rows: one measured with another recipe or other overrides is not a result of it.
    rows = [r for r in load_rows(results) if row_recipe(r) == recipe and r.get("extra", []) == args.extra]
    log = workdir / "lc" / "log.txt"

    def keep(row: dict) -> None:
        row = {**row, "recipe": recipe, "extra": args.extra}
        rows.append(row)
        with results.open("a") as f:
            f.write(json.dumps(row) + "\n")
        write_results_provenance(results, args.recipe, {k: v for k, v in vars(args).items() if k != "recipe"})
        print(json.dumps(row), flush=True)

    def have(kind, f, e, k) -> bool:
        return (kind, f, e, k) in {_key(r) for r in rows}

    for f in families:  # the compared drafts first, then their sweeps, then the curves' other points
        if not have("curve", f, args.epochs, K_REF):
            keep(curve_point(args, workdir, f, args.epochs, log))
    for f in families:
        for k in sorted({*ks, K_REF}):
            if have("sweep", f, args.epochs, k):
                continue
            if k == K_REF:  # the compared draft's own evaluation (same prompts, n-gram at the same K)
                c = next(r for r in rows if _key(r) == ("curve", f, args.epochs, K_REF))
                keep({"kind": "sweep", "family": f, "epochs": args.epochs, "k": k, **{
                    n: c[n] for n in ("served_al", "acceptance_by_position", "ngram_al", "forwards_per_round")}})
            else:
                keep(sweep_point(args, workdir, f, args.epochs, k, log))
    if not args.no_throughput:
        for f in families:
            sw = [r for r in rows if r["kind"] == "sweep" and r["family"] == f and r["epochs"] == args.epochs]
            best_k = max(sw, key=lambda r: r["served_al"])["k"] if sw else K_REF
            for k in sorted(set(args.tput_ks) or {K_REF, best_k}):
                if not have("throughput", f, args.epochs, k):
                    keep(throughput_point(args, workdir, f, args.epochs, k, log))
    for e in curve:
        for f in families:
            if not have("curve", f, e, K_REF):
                keep(curve_point(args, workdir, f, e, log))
    print(tables([r for r in rows if r["family"] in families], families, args.epochs))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    raise SystemExit(main())
