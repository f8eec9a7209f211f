"""Set-up shared by the ingest benches (ingest_regen.py, ingest_capture.py, ingest_dask.py).

Not a bench itself: bench/ is not a package, so each bench loads this file from beside it with
importlib (as featurestore_read.py loads featurestore_write.py). It holds what the three share:

* ``add_args``: ``--prompts``, ``--rounds``, ``--max-tokens``, ``--max-num-seqs``, ``--target``,
  ``--manifest`` with the benches' defaults;
* ``load_prompts``: the manifest with ``generation.max_tokens`` set to ``--max-tokens``, and the first
  ``--prompts`` entries of the training split of its pool;
* ``run_unwinding`` (arms.py's): a SIGTERM unwinds the bench as Ctrl-C does, so its scratch stores go.

eaglenest is imported inside ``load_prompts`` only, so a bench's ``--help`` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

from eaglenest.cli import at_least
from eaglenest.errors import EaglenestError

_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)
run_unwinding = arms.run_unwinding


def add_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments every ingest bench takes (its own ones are added by the bench)."""
    ap.add_argument("--prompts", type=at_least(1), default=256, help="training prompts of the manifest's pool")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--max-tokens", type=at_least(1), default=160, help="generation.max_tokens")
    ap.add_argument("--max-num-seqs", type=at_least(1), default=64, help="the engine's max_num_seqs")
    ap.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    ap.add_argument("--manifest", default="recipes/manifests/toy.yaml", help="the ingest manifest")
    return ap


def load_prompts(a: argparse.Namespace):
    """``(manifest, pool)``: the manifest generating ``a.max_tokens`` tokens, its first ``a.prompts`` train entries."""
    from eaglenest.ingest.manifest import load_manifest
    from eaglenest.ingest.pool import load_pool

    try:
        manifest = load_manifest(a.manifest)
        manifest = dataclasses.replace(manifest, generation=dataclasses.replace(manifest.generation,
                                                                                max_tokens=a.max_tokens))
        pool = [e for e in load_pool(manifest, target=a.target) if e.split == "train"][: a.prompts]
    except EaglenestError as exc:  # a wrong --manifest: one line and exit 2, as the stage CLIs say it
        _refuse(str(exc))
    if not pool:
        _refuse(f"{a.manifest}: no training prompts in its pool")
    return manifest, pool


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
