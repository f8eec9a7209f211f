"""Set-up shared by the ingest benches (ingest_regen.py, ingest_capture.py, ingest_dask.py).

Not a bench itself: bench/ is not a package, so each bench loads this file from beside it with
importlib (as featurestore_read.py loads featurestore_write.py). It holds what the three share:

* ``add_args``: ``--prompts``, ``--rounds``, ``--max-tokens``, ``--max-num-seqs``, ``--target``,
  ``--manifest`` with the benches' defaults;
* ``load_prompts``: the manifest with ``generation.max_tokens`` set to ``--max-tokens``, and the first
  ``--prompts`` entries of the training split of its pool.

eaglenest is imported inside ``load_prompts`` only, so a bench's ``--help`` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses

from eaglenest.cli import at_least


def add_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments every ingest bench takes (its own ones are added by the bench)."""
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--target", default="assets/tiny-target")
    ap.add_argument("--manifest", default="recipes/manifests/toy.yaml")
    return ap


def load_prompts(a: argparse.Namespace):
    """``(manifest, pool)``: the manifest generating ``a.max_tokens`` tokens, its first ``a.prompts`` train entries."""
    from eaglenest.ingest.manifest import load_manifest
    from eaglenest.ingest.pool import load_pool

    manifest = load_manifest(a.manifest)
    manifest = dataclasses.replace(manifest, generation=dataclasses.replace(manifest.generation,
                                                                            max_tokens=a.max_tokens))
    pool = [e for e in load_pool(manifest, target=a.target) if e.split == "train"][: a.prompts]
    return manifest, pool
