"""What ``train run`` does (the argument table is ``train_cli.py``'s). Imported only when the command
runs: it pulls in torch, the trainer and, for served-AL selection, export and evaluate."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from eaglenest import memfit
from eaglenest.evaluate.settings import evaluate_config
from eaglenest.paths import ensure_writable
from eaglenest.pipeline.served_al import served_al_scorer
from eaglenest.train.loop import train
from eaglenest.train.model import draft_shape


def check_fit(recipe) -> None:
    """Refuse (``memfit``) a step of ``train.batch_rows`` rows of ``train.pack_tokens`` that cannot
    fit this rank's memory (a hub target, without a local config, is not estimated)."""
    cfg = memfit.load_target_config(recipe.run.target)
    if cfg is None:
        return
    t = recipe.train
    cp = max(1, int(getattr(t, "context_parallel", 1) or 1))
    world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    shape = draft_shape(cfg, t.draft.shape())
    memfit.require_fit(memfit.train_estimate(
        pack_tokens=-(-t.pack_tokens // cp), rows=-(-t.batch_rows // max(1, world // cp)),
        hidden=int(cfg["hidden_size"]), num_aux=len(recipe.featurestore.layer_ids) or 3,
        heads=shape["num_attention_heads"], head_dim=shape["head_dim"], intermediate=shape["intermediate_size"],
        draft_vocab=t.draft_vocab_size, target_vocab=int(cfg.get("vocab_size") or t.draft_vocab_size),
        ttt_steps=t.ttt_steps if t.family == "eagle3" else 1, attn_chunk_tokens=t.attn_chunk_tokens,
        target_chunk_tokens=t.target_chunk_tokens))


def cmd_run(recipe, args) -> int:
    """``train run``: train a draft on the features table; with ``train.select.every_steps``, each
    snapshot is scored by serving it (rendered as ``evaluate`` renders: ``evaluate_config``)."""
    main_rank = os.environ.get("RANK", "0") == "0"
    if not main_rank:  # torchrun: one rank reports
        logging.getLogger("eaglenest").setLevel(logging.WARNING)
    r = recipe.run
    if main_rank:  # before the store or the target is read; leaves nothing behind
        ensure_writable(r.path(recipe.train.output_subdir), "run.workdir", keep=False)
    check_fit(recipe)  # a row that cannot fit memory is refused before the store or the target is read
    score = None
    if recipe.train.select.every_steps:
        score = served_al_scorer(recipe.train, evaluate_config(recipe), target_dir=r.target,
                                 store_uri=r.store_uri, trust_remote_code=r.trust_remote_code)
    summary = train(recipe.train, store_uri=r.store_uri, workdir=r.workdir, target_dir=r.target,
                    seed=r.seed, argv=sys.argv, recipe=recipe.to_dict(), score=score,
                    featurestore=recipe.featurestore, target_keys=dataclasses.asdict(r.target_keys),
                    off_policy=r.off_policy, trust_remote_code=r.trust_remote_code)
    if main_rank:
        print(f"draft checkpoint: {summary.outdir} (step {summary.steps}, {summary.num_parameters:,} parameters, "
              f"features v{summary.table_version}, "
              f"data stall {100 * summary.stall_fraction:.2f}%)")
    return 0
