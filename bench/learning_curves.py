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
Results are appended to ``<workdir>/learning_curves.jsonl`` (a re-run skips rows already there: same
name, overrides, epochs and recipe) and printed as a markdown table of this run's variants, with the
ratio of each variant's AL to the first ``--variant``'s at the same epochs; its provenance (the resolved
recipe, the variants, the command) is ``<workdir>/learning_curves.provenance.json``. Outputs go to
``<workdir>/lc_train_<variant>_e<epochs>_<key>``, ``lc_draft_*`` and ``lc/eval_*``, where ``<key>`` is a hash of
the recipe and the overrides (two recipes, or one variant name given other overrides, keep their own
folders), and are kept (drafts can be re-evaluated); the commands run are logged in ``<workdir>/lc/log.txt``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The recipe of rows written before rows named theirs (every one of them was measured with it).
DEFAULT_RECIPE = "recipes/toy.yaml"


def recipe_key(recipe: str) -> str:
    """``--recipe`` as rows record it: relative to the repository root where it lies under it (the commands
    run there), so ``./recipes/toy.yaml`` and an absolute path to it name the same recipe."""
    path = (ROOT / Path(recipe).expanduser()).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def row_recipe(row: dict) -> str:
    return row.get("recipe") or DEFAULT_RECIPE


def _run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def load_rows(path: Path) -> list[dict]:
    """The rows a results file (one JSON object a line) holds. A last line cut short (the bench was
    killed while appending it) is cut off the file, so the re-run measures that point again and its
    append starts on a line of its own instead of gluing onto the torn one."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if whole != data:
        print(f"{path}: its last line was cut short (an interrupted run): dropped, that point is measured again",
              file=sys.stderr)
        with path.open("r+b") as f:
            f.truncate(len(whole))
    rows = []
    for number, line in enumerate(whole.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            print(f"error: {path}: line {number} is not a JSON row; mend or delete it", file=sys.stderr)
            raise SystemExit(2) from None
    return rows


def run_dir(p: argparse.ArgumentParser, text: str) -> Path:
    """``--workdir`` resolved: an existing run folder (the demo's). A mistyped one is a usage error before
    any folder is made in it or any command runs (not a new run folder and a failed ``train run``)."""
    path = Path(text).resolve()
    if not path.is_dir():
        p.error(f"--workdir {text}: no such folder (run `make demo` first, or give the run folder of the demo's store)")
    return path


def variant(text: str) -> tuple[str, list[str]]:
    """An argparse ``type`` for ``--variant name=override[,override...]``."""
    name, sep, overrides = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected name=override[,override...] (name= for the recipe as is), "
                                         f"got {text!r}")
    return name, [o for o in overrides.split(",") if o]


def int_list(low: int, *, empty: bool = False):
    """An argparse ``type``: a comma list of whole numbers, each >= ``low`` ('' = none, where ``empty``)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = None
        if values is None or (not values and not empty) or any(v < low for v in values):
            raise argparse.ArgumentTypeError(f"a comma list of whole numbers, each >= {low}, got {text!r}")
        return values

    parse.__name__ = f"comma list of ints >= {low}"
    return parse


def point_tag(recipe: str, name: str, overrides: list[str], epochs: int) -> str:
    """The folder name part of one point: the variant's name made safe for a folder (``a/b``, ``../x`` or a
    blank stay inside the workdir), its epochs, and a hash of the recipe and the overrides, so that two
    recipes (or one name given other overrides) do not overwrite each other's drafts and reports."""
    key = hashlib.sha256(json.dumps([recipe_key(recipe), list(overrides)]).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name).lstrip('.') or '_'}_e{epochs}_{key}"


def point_dirs(workdir: Path, recipe: str, name: str, overrides: list[str], epochs: int) -> dict[str, Path]:
    """The train, draft and eval folders of one point (:func:`point_tag`)."""
    tag = point_tag(recipe, name, overrides, epochs)
    return {"train": workdir / f"lc_train_{tag}", "draft": workdir / f"lc_draft_{tag}",
            "eval": workdir / "lc" / f"eval_{tag}"}


def measure(recipe: str, workdir: Path, name: str, overrides: list[str], epochs: int, log: Path, *,
            key: list[str] | None = None) -> dict:
    """One point: train, export, evaluate. Its folders are keyed by the recipe and ``key`` (default: the
    overrides; :func:`point_dirs`)."""
    dirs = point_dirs(workdir, recipe, name, overrides if key is None else key, epochs)
    common = ["--recipe", recipe, f"run.workdir={workdir}"]
    train_s = _run([str(BIN / "train"), "run", *common, f"train.num_epochs={epochs}",
                    f"train.output_subdir={dirs['train'].name}", "train.state.resume=never", *overrides], log)
    _run([str(BIN / "serve"), "export", *common, f"serve.checkpoint_subdir={dirs['train'].name}",
          f"serve.draft_subdir={dirs['draft'].name}", *overrides], log)
    out, draft = dirs["eval"], dirs["draft"]
    _run([str(BIN / "evaluate"), "al", *common, f"evaluate.draft={draft}",
          "--out", str(out), "evaluate.context_buckets=[]", "evaluate.ngram_order=0", *overrides], log)
    report = json.loads((out / "report.json").read_text())
    info = json.loads((dirs["train"] / "checkpoint.json").read_text())
    overall, lossless = report["overall"], report.get("lossless") or {}
    return {"variant": name, "overrides": overrides, "epochs": epochs, "steps": info["step"],
            "train_seconds": round(train_s, 1), "served_al": overall["acceptance_length"],
            "acceptance_by_position": overall["acceptance_by_position"],
            "lossless": f"{lossless.get('identical')}/{lossless.get('prompts')}", "prompts": overall["prompts"]}


def write_results_provenance(results: Path, recipe: str, settings: dict) -> Path:
    """``<results>.provenance.json`` beside a results file (as ``featurestore query --out`` names it), of the
    last run that appended to it: the command, the code, the recipe resolved (without the variants'
    overrides; each row records its recipe and overrides) and ``settings``. Each point's own folders hold
    the provenance of the commands that made them."""
    from eaglenest.provenance import write_provenance
    from eaglenest.recipe import load_recipe

    target = results.with_name(results.stem + ".provenance.json")
    with tempfile.TemporaryDirectory(dir=results.parent, prefix=".provenance-") as tmp:
        # read from the checkout, as the commands run there (``_run``)
        resolved = load_recipe(str(ROOT / Path(recipe).expanduser())).to_dict()
        made = write_provenance(tmp, config={"recipe": resolved, "bench": settings},
                                inputs={"recipe": recipe_key(recipe)}, extra={"outputs": {"results": results.name}})
        os.replace(made, target)
    return target


def table(rows: list[dict], first: str | None = None) -> str:
    """The rows as markdown, each AL also as a ratio to variant ``first``'s (default: the first row's) at
    the same epochs."""
    first = first or rows[0]["variant"]
    base = {r["epochs"]: r["served_al"] for r in rows if r["variant"] == first}
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
    p.add_argument("--recipe", default="recipes/toy.yaml", help="the recipe every variant starts from")
    p.add_argument("--workdir", default="runs/toy", help="run directory holding the demo store")
    p.add_argument("--epochs", type=int_list(1), default="2,10", help="comma list of epochs, one point each")
    p.add_argument("--variant", type=variant, action="append", default=[],
                   help="name=override[,override...] (repeatable; default: default=, the recipe as is)")
    args = p.parse_args()
    variants = args.variant or [("default", [])]
    workdir = run_dir(p, args.workdir)
    (workdir / "lc").mkdir(exist_ok=True)
    results = workdir / "learning_curves.jsonl"
    recipe = recipe_key(args.recipe)
    # This run's rows: a row of another recipe, or of other overrides under the same name, is not a result of it.
    rows = [r for r in load_rows(results) if row_recipe(r) == recipe and (r["variant"], r.get("overrides")) in variants]
    log = workdir / "lc" / "log.txt"
    for epochs in args.epochs:
        for name, overrides in variants:
            if any(r["variant"] == name and r["epochs"] == epochs and r["overrides"] == overrides for r in rows):
                continue
            row = {**measure(args.recipe, workdir, name, overrides, epochs, log), "recipe": recipe}
            rows.append(row)
            with results.open("a") as f:
                f.write(json.dumps(row) + "\n")
            write_results_provenance(results, args.recipe, {"variants": [list(v) for v in variants],
                                                            "epochs": args.epochs})
            print(json.dumps(row), flush=True)
    print(table(rows, first=variants[0][0]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    raise SystemExit(main())
