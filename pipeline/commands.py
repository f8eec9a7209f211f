"""What ``train run`` does (the argument table is ``train_cli.py``'s). Imported only when the command
runs: it pulls in torch, the trainer and, for served-AL selection, export and evaluate."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

from eaglenest import memfit
from eaglenest.config import short
from eaglenest.errors import ConfigError
from eaglenest.evaluate.settings import resolve_chat_template_kwargs
from eaglenest.featurestore.table import store
from eaglenest.paths import ensure_writable, shown_path
from eaglenest.pipeline.served_al import served_al_scorer
from eaglenest.target import read_config
from eaglenest.train.config import TrainConfig
from eaglenest.train.dist import rank_env
from eaglenest.train.loop import train
from eaglenest.train.model import draft_shape


#: Keys that size a training step, each reset to its default in turn to find the one driving a refusal.
_SIZE_KEYS = ("pack_tokens", "batch_rows", "ttt_steps", "draft_vocab_size", "peagle.num_slots",
              "peagle.anchors_per_row", "dflash.block_size", "dflash.anchors_per_row", "dflash.num_layers",
              "draft.intermediate_size", "draft.num_attention_heads", "draft.num_key_value_heads", "draft.head_dim")


def check_fit(recipe, *, available: int | None = None) -> None:
    """Refuse (``memfit``) a step of ``train.batch_rows`` rows of ``train.pack_tokens`` that cannot
    fit this rank's memory, with ``train.family``'s per-row query slots and TTT steps; the refusal
    names the key whose default would shrink the step most. A hub target (no local config) is not
    estimated. ``train.draft_vocab_size`` past the target's vocabulary is refused first."""
    cfg = memfit.load_target_config(recipe.run.target)
    if cfg is None:
        return
    _check_target_sizes(cfg, recipe.run.target)
    t = recipe.train
    vocab = int(cfg.get("vocab_size") or t.draft_vocab_size)
    if not 1 <= t.draft_vocab_size <= vocab:
        raise ConfigError(f"train.draft_vocab_size: {t.draft_vocab_size} must be in [2, {vocab}] "
                          "(run.target's vocabulary)")
    estimate = functools.partial(_train_estimate, recipe, cfg)
    est = estimate(t)
    available = memfit.available_bytes() if available is None else int(available)
    if est.total_bytes <= available:
        return
    defaults = TrainConfig()
    gains = []
    for key in _SIZE_KEYS:
        section, _, name = key.rpartition(".")
        now, default = (getattr(getattr(x, section), name) if section else getattr(x, name) for x in (t, defaults))
        if now <= default:
            continue
        try:
            small = (dataclasses.replace(t, **{section: dataclasses.replace(getattr(t, section), **{name: default})})
                     if section else dataclasses.replace(t, **{name: default}))
            gains.append((est.total_bytes - estimate(small).total_bytes, f"train.{key}"))
        except ConfigError:  # the default does not go with another key (row_tokens > pack_tokens; draft heads)
            continue
    key = max(gains)[1] if gains and max(gains)[0] > 0 else "train.pack_tokens"
    memfit.require_fit(dataclasses.replace(est, key=key), available=available)


#: The target config's sizes the estimate reads: required (a positive integer), or optional (null or >= 0).
_TARGET_SIZES = {"hidden_size": True, "num_attention_heads": True, "vocab_size": False, "num_key_value_heads": False,
                 "head_dim": False, "intermediate_size": False}


def _check_target_sizes(cfg: dict, target: str) -> None:
    """One line naming the key for a target config whose sizes are missing or not integers."""
    for key, required in _TARGET_SIZES.items():
        value = cfg.get(key)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < int(required):
            want = "a positive integer" if required else "an integer >= 0 or null"
            raise ConfigError(f"run.target: {shown_path(Path(target) / 'config.json')}: {key}: {want}, "
                              f"got {short(value)}")


def _train_estimate(recipe, cfg: dict, t: TrainConfig) -> memfit.Estimate:
    """memfit's estimate of one step of ``t`` (a train section) on this rank."""
    cp = max(1, int(getattr(t, "context_parallel", 1) or 1))
    world = rank_env().world_size
    shape = draft_shape(cfg, t.draft.shape())
    # anchors past a row's tokens are not drawn: the trainer takes at most one per position
    peagle_anchors, dflash_anchors = (min(a, t.pack_tokens) for a in (t.peagle.anchors_per_row,
                                                                      t.dflash.anchors_per_row))
    family = {"eagle3": dict(ttt_steps=t.ttt_steps),
              "peagle": dict(ttt_steps=1, slots=peagle_anchors * (t.peagle.num_slots - 1)),
              "dflash": dict(ttt_steps=1, slots=dflash_anchors * t.dflash.block_size,
                             layers=t.dflash.num_layers, context_queries=False)}[t.family]
    return memfit.train_estimate(
        pack_tokens=-(-t.pack_tokens // cp), rows=-(-t.batch_rows // max(1, world // cp)),
        hidden=int(cfg["hidden_size"]), num_aux=len(recipe.featurestore.layer_ids) or 3,
        heads=shape["num_attention_heads"], head_dim=shape["head_dim"], intermediate=shape["intermediate_size"],
        draft_vocab=t.draft_vocab_size, target_vocab=int(cfg.get("vocab_size") or t.draft_vocab_size),
        attn_chunk_tokens=t.attn_chunk_tokens, target_chunk_tokens=t.target_chunk_tokens, **family)


def check_select_split(store_uri: str, split: str) -> None:
    """``train.select.every_steps`` serves prompts of ``train.select.split``: refuse, before any work,
    a split the prompts table has no rows of."""
    if not store.exists(store_uri, store.PROMPTS):
        raise ConfigError(f"train.select.split: no prompts table in {store_uri} to select on: run `ingest build` "
                          "first, or set train.select.every_steps=0")
    rows = store.read(store_uri, store.PROMPTS, columns=["sample_id"], filter=f"split = {store.sql_text(split)}")
    if not rows.num_rows:
        raise ConfigError(f"train.select.split: no {split!r} prompts in {store_uri} (ingest writes 'train' and "
                          "'heldout')")


def selection_evaluate_config(recipe):
    """The recipe's evaluate settings for served-AL selection, its chat-template kwargs resolved as
    ``evaluate`` resolves them, and a null ``evaluate.num_speculative_tokens`` left null: each snapshot is
    served at the K its export records (this run's family). Whatever an earlier run exported to
    ``<workdir>/<serve.draft_subdir>`` is not read: a damaged export there would refuse the training."""
    return dataclasses.replace(recipe.evaluate, chat_template_kwargs=resolve_chat_template_kwargs(recipe))


def cmd_run(recipe, args) -> int:
    """``train run``: train a draft on the features table; with ``train.select.every_steps``, each
    snapshot is scored by serving it (rendered as ``evaluate`` renders: ``resolve_chat_template_kwargs``)."""
    main_rank = rank_env().rank == 0  # a torchrun variable that cannot be torchrun's: one line, before any work
    if not main_rank:  # torchrun: one rank reports
        logging.getLogger("eaglenest").setLevel(logging.WARNING)
    r = recipe.run
    if main_rank:  # before the store or the target is read; leaves nothing behind
        ensure_writable(r.path(recipe.train.output_subdir), "run.workdir", keep=False)
        if recipe.train.track.tensorboard:  # relative to the output folder, or absolute
            ensure_writable(Path(r.path(recipe.train.output_subdir)) / recipe.train.track.dir, "train.track.dir",
                            error=ConfigError, keep=False)
    read_config(r.target)  # a target that is not there: one line naming it, before its identity is compared
    check_fit(recipe)  # a row that cannot fit memory is refused before the store or the target is read
    score = None
    if recipe.train.select.every_steps:
        check_select_split(r.store_uri, recipe.train.select.split)
        score = served_al_scorer(recipe.train, selection_evaluate_config(recipe), target_dir=r.target,
                                 store_uri=r.store_uri, trust_remote_code=r.trust_remote_code,
                                 serve_cfg=recipe.serve, off_policy=r.off_policy)
    summary = train(recipe.train, store_uri=r.store_uri, workdir=r.workdir, target_dir=r.target,
                    # argv None: the provenance writer names a `python -m` run's module (torchrun's ranks),
                    # where sys.argv holds its file's absolute path
                    seed=r.seed, argv=None, recipe=recipe.to_dict(), score=score,
                    featurestore=recipe.featurestore, target_keys=dataclasses.asdict(r.target_keys),
                    off_policy=r.off_policy, trust_remote_code=r.trust_remote_code)
    if main_rank:
        print(f"draft checkpoint: {summary.outdir} (step {summary.steps}, {summary.num_parameters:,} parameters, "
              f"features v{summary.table_version}, "
              f"data stall {100 * summary.stall_fraction:.2f}%)")
    return 0
