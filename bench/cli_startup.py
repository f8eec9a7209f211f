"""Start-up time of every CLI's ``--help``: this checkout against another revision, side by side.

Usage::

    .venv/bin/python bench/cli_startup.py --base f933bc6 [--runs 21]

The other revision is checked out into a temporary ``git worktree`` and made importable as the
``eaglenest`` namespace by a folder of links (the same layout ``pyproject.toml``'s package-dir
gives the install), put first on ``PYTHONPATH`` so it wins over the editable install of this
checkout. Each run is a fresh interpreter (``python -c "...main(['--help'])"``, output discarded);
the two revisions alternate run by run, so load on the machine hits both alike. Prints per CLI the
median wall time of each and the ratio this/base with the ratio's interquartile range over the
paired runs. ``--help`` imports what the command's argument table needs and nothing heavy (torch,
vLLM, Lance are imported only when a command runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "featurestore", "train", "serve", "evaluate", "tinytarget", "pipeline")
CLIS = {"ingest": "eaglenest.ingest.cli", "featurestore": "eaglenest.featurestore.cli",
        "train": "eaglenest.pipeline.train_cli", "serve": "eaglenest.serve.cli",
        "evaluate": "eaglenest.evaluate.cli"}


def link_farm(checkout: Path, dest: Path) -> Path:
    """``dest/eaglenest`` laid out as the install lays out ``checkout`` (common/ is the namespace)."""
    pkg = dest / "eaglenest"
    pkg.mkdir(parents=True)
    for item in (checkout / "common").iterdir():
        (pkg / item.name).symlink_to(item)
    for stage in STAGES:
        if (checkout / stage).is_dir():
            (pkg / stage).symlink_to(checkout / stage)
    return dest


def one_run(module: str, pythonpath: str | None) -> float:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = f"import sys; from {module} import main; sys.exit(main(['--help']))"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, check=False)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:  # a failing --help is fast: timing it would flatter whichever side broke
        where = "the base revision" if pythonpath else "this checkout"
        raise SystemExit(f"{module} --help failed (exit {proc.returncode}) in {where}: "
                         f"{proc.stderr.strip().splitlines()[-1:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision to compare with (e.g. f933bc6)")
    ap.add_argument("--runs", type=int, default=21, help="paired runs per CLI (at least 2)")
    args = ap.parse_args(argv)
    if args.runs < 2:  # the ratio's interquartile range needs two paired runs
        ap.error(f"--runs: at least 2, got {args.runs}")
    known = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}"],
                           capture_output=True, check=False)
    if known.returncode != 0:  # else `git worktree add` failed with a CalledProcessError traceback
        ap.error(f"--base {args.base}: not a revision of this repository")
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(wt), args.base], check=True)
        try:
            farm = str(link_farm(wt, Path(tmp) / "path"))
            print(f"--help wall time, median of {args.runs} paired runs (this checkout vs {args.base})")
            print(f"{'cli':<13} {'base ms':>8} {'this ms':>8} {'this/base':>10} {'IQR of ratio':>16}")
            for name, module in CLIS.items():
                base, this = [], []
                for i in range(args.runs):
                    pair = [(base, farm), (this, None)]
                    for out, path in (pair if i % 2 == 0 else pair[::-1]):
                        out.append(one_run(module, path))
                ratios = sorted(t / b for t, b in zip(this, base))
                q = statistics.quantiles(ratios, n=4)
                print(f"{name:<13} {statistics.median(base) * 1e3:8.1f} {statistics.median(this) * 1e3:8.1f} "
                      f"{statistics.median(ratios):10.3f} {f'[{q[0]:.3f}, {q[2]:.3f}]':>16}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
