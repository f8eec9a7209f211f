"""What ``serve export`` does (the argument table is ``cli.py``'s). Imported only when the command
runs: exporting pulls in torch and the trainer's checkpoint format."""

from __future__ import annotations

import sys
from pathlib import Path

from eaglenest.featurestore.table.objects import is_remote, local
from eaglenest.paths import ensure_writable
from eaglenest.serve.export import export_draft
from eaglenest.train.config import TrainConfig


def cmd_export(recipe, args) -> int:
    """``serve export``: the checkpoint in ``serve.checkpoint_subdir`` as a draft in ``--out``."""
    r, s = recipe.run, recipe.serve
    out = args.out or str(r.path(s.draft_subdir))
    key = "--out" if args.out else "serve.draft_subdir"
    # The draft is written beside ``out`` and renamed into place: prove that folder writable before
    # the checkpoint is read (the check leaves nothing behind).
    ensure_writable(Path(out).parent, "--out" if args.out else "run.workdir", keep=False)
    # Never over the checkpoint, the store or the workdir itself; export_draft refuses any other
    # folder that is not an earlier export.
    store = () if is_remote(r.store_uri) else (("the feature store", local(r.store_uri)),)  # file:// is local
    path = export_draft(r.path(s.checkpoint_subdir), out, target_dir=r.target, dtype=s.dtype,
                        quantization=s.quantization, format=s.format,
                        num_speculative_tokens=s.num_speculative_tokens, argv=sys.argv, recipe=recipe.to_dict(),
                        key=key, keep_clear=store, not_at=(("run.workdir", r.workdir),), family=asked_family(recipe),
                        off_policy=r.off_policy)
    print(f"draft: {path}")
    return 0


def asked_family(recipe) -> str | None:
    """The family the recipe asks ``serve export`` for: ``train.family`` when it names one other than
    the default (a recipe left at the default exports the checkpoint's own family, as it always did)."""
    family = recipe.train.family
    return None if family == TrainConfig.family else family
