"""The trainer: pinned features -> draft vocab -> TTT training with AdamW -> checkpoint.

:func:`train` reads top to bottom: open the data source (:mod:`eaglenest.train.source`, chosen once
from ``train.source``), check it against the target, build the draft (:class:`_Draft`), set up the
optimiser, plan and resumed state (:class:`_Trainer`), run the steps, save the checkpoint.

One code path for a plain process and for torchrun (FSDP2 over a gloo/nccl group, see
:mod:`eaglenest.train.dist`). Every rank builds the same global batch plan and trains on its rows
of each global batch; losses are normalised by GLOBAL per-step token counts, so the ranks' losses
and gradients sum to exactly the 1-rank ones (FSDP2 averages gradients, hence ``loss * world``).
Everything that makes a run differ is explicit: the table version (pinned in provenance and
state), the seed (init, sample order, packing) and the config. Same seed, same thread count ->
the same weights bit for bit, also across a SIGKILL and ``train.state.resume=auto``
(:mod:`eaglenest.train.state`). Served-AL selection's books and the report live in
:mod:`eaglenest.train.selection`; the scorer, which serves the draft, is passed in from above the
stages (the ``train run`` command, :mod:`eaglenest.pipeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from eaglenest.errors import ConfigError, EaglenestError, SchemaError, StoreError
from eaglenest.paths import make_dir
from eaglenest.featurestore.capture import policy
from eaglenest.provenance import finite_or_null, write_provenance
from eaglenest.train import checkpoint, context_parallel as CP, selection, state as S, track, vocab as V
from eaglenest.train.config import TrainConfig
from eaglenest.train.data import Prefetcher
from eaglenest.train.dist import DistState
from eaglenest.train.model import Eagle3Draft, draft_config, draft_shape, init_weights, num_parameters
from eaglenest.train import dflash, peagle
from eaglenest.train.source import DataSource, open_source
from eaglenest.train.target import load_target_tensors
from eaglenest.train.ttt import TargetHead, target_targets

log = logging.getLogger(__name__)

#: Held (flock) by rank 0 while a run writes its output folder (:func:`hold_outdir`).
LOCK = ".lock"


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    outdir: Path
    steps: int
    table_version: int
    final: dict[str, Any]
    #: Seconds the steps waited for data / seconds of the training loop.
    stall_fraction: float = 0.0
    tokens_per_second: float = 0.0
    #: Parameters of the draft (the target's shared embeddings excluded).
    num_parameters: int = 0


@contextlib.contextmanager
def hold_outdir(outdir: Path, dist: DistState):
    """Rank 0 holds an exclusive lock on ``<outdir>/.lock`` while the run writes there (a collective):
    a second ``train run`` of the same folder (launched twice) would resume the same state and write
    the same steps again. The kernel drops the lock when the process dies, SIGKILL included."""
    held, refusal = _lock(outdir) if dist.is_main else (None, None)
    try:
        refusal = dist.broadcast_object(refusal)  # every rank stops with rank 0's line
        if refusal:
            raise StoreError(refusal)
        yield
    finally:
        if held is not None:
            held.close()


def _lock(outdir: Path):
    """(the open, locked lock file or None, the refusal line or None) of :func:`hold_outdir`."""
    try:
        make_dir(outdir, "run.workdir")
        held = (outdir / LOCK).open("a")
    except EaglenestError as exc:  # a read-only or full disk
        return None, str(exc)
    except OSError as exc:
        return None, f"run.workdir: cannot write {outdir / LOCK} ({exc.strerror or exc})"
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        return None, (f"{outdir}: another `train run` is writing this folder (it holds {outdir / LOCK}); "
                      "wait for it to end, or set another run.workdir or train.output_subdir")
    except OSError as exc:  # a filesystem without locks: the run goes on unguarded
        log.warning("%s: cannot lock (%s); make sure no other `train run` writes this folder", outdir, exc)
    return held, None


def attention_span(cfg: TrainConfig, lengths) -> int:
    """``train.sliding_window`` in positions: "auto" is the longest span a training query attends
    over (the longest sample, truncated at ``pack_tokens``); 0 means no window. A DFlash draft's layers
    attend to the whole context: "auto" is no window there."""
    if cfg.sliding_window == "auto" and cfg.family == "dflash":
        return 0
    if cfg.sliding_window == "auto":
        return int(min(max((int(n) for n in lengths), default=cfg.pack_tokens), cfg.pack_tokens))
    return int(cfg.sliding_window)


def resolved_keys(cfg: TrainConfig, target_cfg: dict[str, Any], lengths) -> dict[str, Any]:
    """The train keys with several spellings of one value, as this run resolves them (state.RESOLVED):
    another spelling of the same window, row fill or draft size trains the same draft and resumes."""
    shape = draft_shape(target_cfg, cfg.draft.shape())
    return {"sliding_window": attention_span(cfg, lengths), "row_tokens": cfg.row_tokens or cfg.pack_tokens,
            **{f"draft.{k}": int(v) for k, v in shape.items()}}


def build_draft(cfg: TrainConfig, target: dict[str, Any], *, layer_ids: tuple[int, ...],
                vocab: V.DraftVocab, seed: int, sliding_window: int = 0) -> Eagle3Draft | dflash.DFlashDraft:
    """A freshly initialised draft of ``train.family`` with the target's embeddings and the vocab
    maps set. ``sliding_window``: positions the draft attends over (0: all; see :func:`attention_span`)."""
    dcfg = draft_config(target["config"], draft_vocab_size=vocab.size,
                        layer_ids=tuple(sorted(layer_ids)), flags=cfg.flags(),
                        sliding_window=sliding_window, shape=cfg.draft.shape())
    dcfg.attn_chunk_tokens = int(cfg.attn_chunk_tokens)
    if cfg.family == "peagle":  # train.family: the draft gets mask_hidden and its mask token id
        peagle.configure(dcfg, cfg.peagle, target["config"])
    if cfg.family == "dflash":  # train.family: Qwen3-style block layers, mask token, block size
        dflash.configure(dcfg, cfg.dflash, target["config"])
    model = dflash.DFlashDraft(dcfg) if cfg.family == "dflash" else Eagle3Draft(dcfg)
    init_weights(model, seed=seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target["embed"])
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
        if cfg.init_lm_head == "target":  # the target's own output rows of the draft vocabulary
            model.lm_head.weight.copy_(target["lm_head"][torch.from_numpy(vocab.draft_ids)])
        if cfg.init_norm == "target":
            model.norm.weight.copy_(target["norm"])
    return model


def build_objective(cfg: TrainConfig, draft, *, seed: int) -> torch.nn.Module:
    """``train.family``'s objective around ``draft``: chosen here, once."""
    if cfg.family == "dflash":
        return dflash.DFlashObjective(draft, cfg.dflash, seed=seed)
    if cfg.context_parallel > 1:  # EAGLE-3 only (train.config refuses the other families)
        return CP.CPObjective(draft)
    return peagle.build_objective(cfg, draft, seed=seed)


def mask_ids_as_default(cfg: TrainConfig, target_cfg: dict[str, Any]) -> TrainConfig:
    """``cfg`` with a ``train.peagle``/``train.dflash`` ``mask_token_id`` equal to the one null resolves to
    (the target's pad, else eos) written null, as the resume fingerprint compares it: the same draft trains."""
    for name in ("peagle", "dflash"):
        section = getattr(cfg, name)
        if section.mask_token_id is None:
            continue
        try:
            default = peagle.resolve_mask_token(None, target_cfg, f"train.{name}.mask_token_id")
        except ConfigError:  # the target names neither: an explicit id is the only one
            continue
        if section.mask_token_id == default:
            cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(section, mask_token_id=None)})
    return cfg


def objective_steps(cfg: TrainConfig) -> int:
    """Predictions per position/anchor of ``train.family``'s objective (the per-step metrics' length)."""
    return dflash.num_steps(cfg) if cfg.family == "dflash" else peagle.num_steps(cfg)


def lr_factor(step: int, *, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def check_num_threads(num_threads: int) -> None:
    """Refuse more intra-op threads than the CPUs this process may use (the default always runs):
    they only compete for the same cores, and torch's OpenMP pool crashed the process (SIGSEGV) when
    asked for 100000."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = max(cpus, TrainConfig.num_threads)
    if num_threads > limit:
        raise ConfigError(f"train.num_threads: {num_threads} threads per rank is more than the {cpus} CPU(s) this "
                          f"process may use: at most {limit}")


def _check_warmup(cfg: TrainConfig, total: int) -> None:
    """Warn (once, at start) when ``train.warmup_steps`` takes the whole run: the learning rate then
    rises to ``total / warmup_steps`` of ``train.lr`` and never decays (docs/training.md). Not
    refused: a short run of the default recipe (``train.num_steps=2``) is a common smoke test."""
    if total and cfg.warmup_steps >= total:
        log.warning("train.warmup_steps=%d is not below the %d step(s) this run trains: the learning rate only "
                    "rises, to %.3g at the last step (train.lr=%g x %d/%d), and never decays; lower "
                    "train.warmup_steps", cfg.warmup_steps, total, cfg.lr * total / cfg.warmup_steps, cfg.lr, total,
                    cfg.warmup_steps)


def train(cfg: TrainConfig, *, store_uri: str, workdir: str, target_dir: str, seed: int,
          argv: list[str] | None = None, recipe: dict[str, Any] | None = None,
          score=None, dist: DistState | None = None, featurestore=None,
          target_keys: dict[str, str] | None = None, off_policy: bool = False,
          trust_remote_code: bool = False) -> TrainSummary:
    """Train a draft on ``store_uri``'s features and write ``<workdir>/<output_subdir>/``.

    ``target_keys``: ``run.target_keys`` (where the target's embed/norm/lm_head are); ``off_policy``:
    ``run.off_policy`` (train on features of responses another target generated).
    ``score``: served-AL scorer for ``train.select.every_steps`` (snapshot dir -> ``{"served_al",
    "prompts"}``; ``served_al_scorer`` in :mod:`eaglenest.pipeline`). ``featurestore``: its
    FeaturestoreConfig: the feature table to read (``featurestore.table``) and, for
    ``train.source=stream``, the capture engine and layer ids. ``dist``: default joins torchrun's
    process group when launched by torchrun (and leaves it at the end).
    """
    selection.require_scorer(cfg.select, score)
    track.require(cfg.track)  # a tracker named but not installed: one line, before any work
    seed = cfg.seed if cfg.seed is not None else seed
    # The feature set to train on: the table the recipe's capture writes (featurestore.table).
    table = getattr(featurestore, "table", None) or "features"
    with contextlib.ExitStack() as own:
        if dist is None:  # torchrun's process group when launched by torchrun, left at the end
            dist = DistState.from_env()
            own.callback(dist.close)
        cp = CP.ContextParallel.create(cfg.context_parallel, dist)  # before any data is read
        check_num_threads(cfg.num_threads)
        torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(seed)
        with contextlib.closing(open_source(cfg, store_uri, table=table, seed=seed, target_dir=target_dir,
                                            featurestore=featurestore,
                                            trust_remote_code=trust_remote_code)) as data:
            policy.check_features(data.meta, target_dir, off_policy=off_policy, stage="train run")
            policy.check_prompts(store_uri, target_dir, off_policy=off_policy, stage="train run")
            target = load_target_tensors(target_dir, keys=target_keys)
            if data.meta.hidden_size != target["config"]["hidden_size"]:
                raise SchemaError(f"features were captured with hidden size {data.meta.hidden_size}, "
                                  f"run.target {target_dir} has {target['config']['hidden_size']}")
            draft = _Draft.build(cfg, data, target, seed=seed, dist=dist)
            base = {"table": table, "table_version": data.version, "store_uri": store_uri, "target": target_dir,
                    "layer_ids": list(sorted(data.meta.layer_ids)), "feature_meta": json.loads(data.meta.to_json()),
                    "train_config": dataclasses.asdict(cfg), "seed": seed, "vocab_coverage": draft.coverage,
                    "world_size": dist.world_size, "num_parameters": draft.num_parameters,
                    "target_keys": target["keys"], "target_weights_sha256": policy.target_id(target_dir)}
            fp = S.fingerprint(mask_ids_as_default(cfg, target["config"]), table_version=data.version,
                               store_uri=store_uri, target=target_dir, seed=seed, table=table,
                               resolved=resolved_keys(cfg, target["config"], data.lengths))
            # The inputs are good: from here on the run writes its folder, alone (a refusal above wrote nothing).
            own.enter_context(hold_outdir(Path(workdir) / cfg.output_subdir, dist))
            trainer = _Trainer(cfg, draft, data, outdir=Path(workdir) / cfg.output_subdir, fp=fp, base=base,
                               dist=dist, score=score, target_dir=target_dir, recipe=recipe, cp=cp)
            own.callback(trainer.tracking.close)
            trainer.run()
        trainer.finish(recipe=recipe, argv=argv, inputs={"store_uri": store_uri, "version": data.version,
                                                         "table": data.input_table, "target": target_dir,
                                                         "weights_sha256": base["target_weights_sha256"]})
        return TrainSummary(outdir=trainer.outdir, steps=trainer.step, table_version=data.version,
                            final=trainer.final, stall_fraction=trainer.stall_fraction,
                            tokens_per_second=trainer.tokens_per_second, num_parameters=draft.num_parameters)


@dataclasses.dataclass
class _Draft:
    """The draft under training and what its loss needs of the target, on this rank's device."""

    #: TTTObjective, PEagleObjective or DFlashObjective (train.family: the draft plus its loss),
    #: FSDP2-sharded under torchrun.
    objective: torch.nn.Module
    head: TargetHead
    #: Target ids of the draft vocabulary; a bool per target id, True inside it.
    draft_target_ids: torch.Tensor
    in_draft_vocab: torch.Tensor
    #: Share of the training loss tokens inside the draft vocabulary.
    coverage: float
    num_parameters: int
    #: A freshly initialised plain draft of the same shape (the gathered weights' host).
    fresh: Callable[[], Eagle3Draft]

    @classmethod
    def build(cls, cfg: TrainConfig, data: DataSource, target: dict[str, Any], *, seed: int,
              dist: DistState) -> "_Draft":
        # Draft vocabulary: the most frequent loss tokens (the table: one SQL aggregate at the pinned version).
        counts = data.loss_token_counts(int(target["config"]["vocab_size"]))
        vocab = V.select_vocab(counts, cfg.draft_vocab_size)
        log.info("features v%d: %d rows, %d loss tokens; draft vocab %d covers %.1f%% of them",
                 data.version, data.num_rows, int(counts.sum()), vocab.size, 100 * V.coverage(counts, vocab))
        window = attention_span(cfg, data.lengths)
        if window:
            log.info("draft attention window: %d positions (train.sliding_window=%s)", window, cfg.sliding_window)

        def fresh() -> Eagle3Draft:
            return build_draft(cfg, target, layer_ids=data.meta.layer_ids, vocab=vocab, seed=seed, sliding_window=window)

        first = fresh()
        n = num_parameters(first)
        c = first.config
        log.info("draft: %s parameters (hidden %d, heads %d/%d x %d, MLP %d, draft vocab %d)", f"{n:,}",
                 c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                 vocab.size)
        if cfg.family == "dflash" and cfg.dflash.num_layers > 1 and dist.distributed:
            raise ConfigError("train.dflash.num_layers: a DFlash draft of more than one layer trains in one process "
                              "for now (its layers share k_norm, which FSDP2 cannot shard per layer): use 1 rank")
        return cls(objective=dist.shard(build_objective(cfg, first, seed=seed).to(dist.device), param_dtype=cfg.param_dtype),
                   head=TargetHead(target["norm"], target["lm_head"], target["rms_norm_eps"]).to(dist.device),
                   draft_target_ids=torch.from_numpy(vocab.draft_ids).to(dist.device),
                   in_draft_vocab=vocab.t2d.to(dist.device), coverage=V.coverage(counts, vocab),
                   num_parameters=n, fresh=fresh)


class _Trainer:
    """One run after the draft is built: the plan, AdamW and its schedule, the resumed position,
    the metrics window and the books (metrics.jsonl, served-AL selection, training state)."""

    def __init__(self, cfg: TrainConfig, draft: _Draft, data: DataSource, *, outdir: Path, fp: dict[str, Any],
                 base: dict[str, Any], dist: DistState, score, target_dir: str,
                 recipe: dict[str, Any] | None = None, cp: CP.ContextParallel | None = None):
        self.cfg, self.draft, self.data, self.dist, self.outdir, self.fp = cfg, draft, data, dist, outdir, fp
        #: train.context_parallel > 1: the (dp, cp) mesh; the dp groups split the rows, cp ranks a row.
        self.cp = cp
        #: Run facts for checkpoint.json: table, version, config, coverage, ...
        self.base = base
        self.schedule = []  # the epochs' batches, as many epochs as num_steps needs (all of them for 0)
        for e in range(cfg.num_epochs):
            if cfg.num_steps and len(self.schedule) >= cfg.num_steps:
                break
            self.schedule += [(e, rows) for rows in data.plan(e)]
        total = min(len(self.schedule), cfg.num_steps) if cfg.num_steps else len(self.schedule)
        self.total = total
        if dist.is_main:
            _check_warmup(cfg, total)
        # train.num_steps as resolved (state.RESOLVED): 0 (every epoch's steps) and that number train alike.
        self.fp = {**fp, S.RESOLVED: {**fp.get(S.RESOLVED, {}), "num_steps": total}}
        if cfg.num_steps:  # the steps it trains: with them equal, another num_epochs resumes (state.PLAN_STEPS)
            self.fp = {**self.fp, S.PLAN_STEPS: total}
        self.params = [p for p in draft.objective.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(
            s, total=total, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio))
        self.state_dir = outdir / "state"
        self.step, self.window = self._resume()
        self.selector = selection.Selector(outdir, cfg=cfg.select, score=score, target_dir=target_dir,
                                           active=dist.is_main, resume_step=self.step)
        self.metrics_path = outdir / "metrics.jsonl"
        if dist.is_main:
            make_dir(outdir, "run.workdir")  # a read-only or full disk: one line, exit 2
            selection.truncate_jsonl(self.metrics_path, self.step)
        # TensorBoard and the recipe's tracker (rank 0), cut back to the resumed step like metrics.jsonl;
        # none for a finished run (a re-run with nothing left to do starts no tracker run).
        self.tracking = track.Tracking.open(cfg.track, outdir, resume_step=self.step,
                                            active=dist.is_main and self.step < total,
                                            workdir=str(outdir.parent),
                                            config=recipe or {"train": dataclasses.asdict(cfg)})
        self.final: dict[str, Any] = {}
        self.steps_run, self.stall_fraction, self.tokens_per_second = 0, 0.0, 0.0
        #: Loss positions of this run's steps (all ranks); None for a resumed run (its first steps trained).
        self.positions_trained: int | None = 0 if self.step == 0 else None

    def _resume(self) -> tuple[int, list[dict[str, Any]]]:
        """(step, open metrics window) of the state to continue from; (0, []) to start over."""
        dist = self.dist
        dist.check_shared_dir(self.outdir)  # each rank writes its DCP shard there (docs/training.md, "Multi-node")
        # Rank 0's view of the latest state decides for all (another node's cache might lag behind).
        latest = None
        if self.cfg.state.resume == "auto" and dist.is_main:
            try:
                latest = S.read_latest(self.state_dir)
            except EaglenestError as exc:  # a damaged state: every rank raises the same one line
                latest = {"damaged": str(exc)}
        latest = dist.broadcast_object(latest)
        if latest is not None and "damaged" in latest:
            raise StoreError(latest["damaged"])
        info = S.resolve(latest, self.fp, self.state_dir)
        if dist.is_main:  # a start-over keeps the old state aside until the new run has saved one
            selection.recover_best(self.outdir)  # a best/ swap a kill interrupted, before best/ moves with its books
            books = (self.outdir / "metrics.jsonl", self.outdir / selection.SELECTION, self.outdir / selection.BEST)
            S.settle(self.state_dir, info, books=books + track.books(self.cfg.track, self.outdir,
                                                                      taken={b.name for b in books} | {"state"}))
        dist.barrier()
        if info is not None:
            info = {**info, "path": str(self.state_dir / Path(info["path"]).name)}
            S.load_state(info, objective=self.draft.objective, opt=self.opt, sched=self.sched, dist=dist)
        return (info["step"], info.get("window", [])) if info else (0, [])

    def run(self) -> None:
        """The steps left of the plan, then the loop's data stall and throughput."""
        cfg, dist = self.cfg, self.dist
        todo = self.schedule[self.step:self.total]
        rank, world = (dist.rank, dist.world_size) if self.cp is None else (self.cp.dp_rank, self.cp.dp_size)
        self.data.start(todo, world_size=world)
        loader = Prefetcher(self.data, todo, rank=rank, world_size=world, depth=cfg.prefetch_batches)
        start, tokens_seen = time.monotonic(), 0.0
        loop_t0, last_t, last_wait, last_tokens = time.perf_counter(), time.perf_counter(), 0.0, 0.0
        bar = tqdm(total=self.total, initial=self.step, desc="train", unit="step",
                   disable=None if dist.is_main else True)
        self.draft.objective.train()
        try:
            for epoch, rows, batch, ghost in loader:
                res, denoms, local_tokens = self._step(batch, ghost)
                self.step += 1
                self.steps_run += 1
                k = len(denoms)
                if self.positions_trained is not None:
                    self.positions_trained += int(sum(denoms))
                g = dist.all_reduce_sum([float(res.loss.detach()), *res.step_loss, *res.step_correct, local_tokens])
                if not math.isfinite(g[0]):  # every rank sees the same sum: all stop here, nothing saved
                    raise StoreError(self._not_finite(g[0], epoch=epoch, rows=rows))
                tokens_seen += g[-1]
                self.window.append({"loss": g[0], "step_loss": g[1:1 + k], "step_correct": g[1 + k:1 + 2 * k],
                                    "step_count": denoms, "tokens": g[-1]})
                if self.step % cfg.log_every_steps == 0 or self.step == self.total:
                    now = time.perf_counter()
                    stall = (loader.wait_seconds - last_wait) / max(now - last_t, 1e-9)
                    # This process's tokens and wall time since the last record (a window restored
                    # from a state holds steps of the run before, not timed here).
                    speed = (tokens_seen - last_tokens) / max(now - last_t, 1e-9)
                    self._log(epoch=epoch, seconds=time.monotonic() - start, stall=stall, tokens_per_second=speed)
                    last_t, last_wait, last_tokens = now, loader.wait_seconds, tokens_seen
                    bar.set_postfix(loss=f"{self.final['loss']:.3f}", acc0=f"{self.final['step_acc'][0]:.2f}")
                bar.update(1)
                self._checkpoints()
        finally:
            loader.close()
            bar.close()
        loop_s = time.perf_counter() - loop_t0
        self.stall_fraction = loader.wait_seconds / loop_s if self.steps_run else 0.0
        self.tokens_per_second = tokens_seen / loop_s if self.steps_run else 0.0

    def _not_finite(self, loss: float, *, epoch: int, rows: list[list[int]]) -> str:
        samples = sorted(i for row in rows for i in row)
        shown = ", ".join(map(str, samples[:8])) + (", ..." if len(samples) > 8 else "")
        return (f"step {self.step} (epoch {epoch}): the loss is {loss}: the hidden states of this step's "
                f"samples ({shown} of train.split={self.cfg.split!r} in {self.data.input_table} v{self.data.version}, "
                f"in table order) hold non-finite values, or train.lr={self.cfg.lr} diverges; stopped before "
                "saving the step (the last state and checkpoint are kept)")

    def _step(self, batch, ghost: bool):
        """One optimizer step on this rank's batch: (TTT result, global per-step counts, local tokens)."""
        cfg, d, dist = self.cfg, self.draft, self.dist
        if ghost:
            batch.loss_mask = torch.zeros_like(batch.loss_mask)
        batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(dist.device)
                                              for f in dataclasses.fields(batch)})
        if self.cp is not None:  # this rank's positions of each row, and the TTT halo after them
            batch = self.cp.split(batch, halo=objective_steps(cfg) + 1)
        probs, argmax = target_targets(d.head, batch.last_hidden, d.draft_target_ids,
                                       chunk_tokens=cfg.target_chunk_tokens)
        if self.step == 0 and dist.is_main:
            _check_target_agreement(batch, argmax)
        if cfg.oov_positions == "drop":
            batch = drop_oov_positions(batch, argmax, d.in_draft_vocab)
        # train.family's objective: P-EAGLE draws its anchors here (a pure function of seed, step, rows).
        batch = d.objective.prepare(batch, step=self.step)
        k = objective_steps(cfg)
        denoms = dist.all_reduce_sum(d.objective.counts(batch, k))
        res = d.objective(batch, probs, argmax, num_steps=k, step_decay=cfg.step_decay,
                          denominators=denoms, chunk_tokens=cfg.target_chunk_tokens)
        self.opt.zero_grad(set_to_none=True)
        (res.loss * dist.world_size).backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        return res, denoms, 0 if ghost else CP.real_tokens(batch)

    def _log(self, *, epoch: int, seconds: float, stall: float, tokens_per_second: float) -> None:
        """Close the metrics window: ``self.final``, a metrics.jsonl line, the trackers' scalars and a
        log line (rank 0)."""
        self.final = _summarise(self.window, step=self.step, epoch=epoch, lr=self.sched.get_last_lr()[0],
                                seconds=seconds, stall=stall, tokens_per_second=tokens_per_second)
        self.window = []
        if self.dist.is_main:
            with self.metrics_path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(finite_or_null(self.final, "", []), allow_nan=False) + "\n")  # strict JSON
            self.tracking.log(track.scalars(self.final), self.step)
            log.info("step %d/%d loss %.4f acc %s stall %.1f%%", self.step, self.total, self.final["loss"],
                     " ".join(f"{a:.2f}" for a in self.final["step_acc"]), 100 * stall)

    def _checkpoints(self) -> None:
        """After a step: the served-AL evaluation and the training state, when due."""
        cfg, step = self.cfg, self.step
        if cfg.select.every_steps and (step % cfg.select.every_steps == 0 or step == self.total):
            served = self.selector.evaluate(step, self.snapshot(), info={**self.base, "step": step,
                                                                         "metrics": self.final})
            if served is not None:
                self.tracking.log({"select/served_al": served}, step)
            self.dist.barrier()
        if step < self.total and cfg.state.every_steps and step % cfg.state.every_steps == 0:
            self._save_state(finished=False)

    def _save_state(self, *, finished: bool) -> None:
        if self.positions_trained == 0:  # every rank sees the same sums: all stop here, nothing saved
            raise StoreError(self._nothing_trained())
        S.save_state(self.state_dir, step=self.step, objective=self.draft.objective, opt=self.opt, sched=self.sched,
                     dist=self.dist, fp=self.fp, extra={"window": self.window, "finished": finished},
                     keep=self.cfg.state.keep)

    def _nothing_trained(self) -> str:
        """Why the steps so far had no position to train on, and the key that changes it."""
        cfg = self.cfg
        drop = " (or train.oov_positions=drop left none)" if cfg.oov_positions == "drop" else ""
        if any(int(n) > cfg.pack_tokens for n in self.data.lengths):
            return (f"steps 1-{self.step}: no position to train on: the loss tokens of their samples lie past "
                    f"train.pack_tokens={cfg.pack_tokens}, where rows are cut{drop}; nothing saved: "
                    "raise train.pack_tokens")
        # Every sample is whole in its row: its loss tokens are only where nothing predicts them.
        return (f"steps 1-{self.step}: no position to train on: no sample of train.split={cfg.split!r} has a loss "
                "token at its third position or later (the first prediction at position t is token t+2; samples "
                f"of at most 2 tokens train nothing){drop}; nothing saved: train on longer samples")

    def snapshot(self) -> Eagle3Draft | None:
        """The current weights as a plain draft on rank 0 (a collective under FSDP2)."""
        return _full_draft(self.draft.objective, self.draft.fresh, self.dist)

    def finish(self, *, recipe: dict[str, Any] | None, argv: list[str] | None, inputs: dict[str, Any]) -> None:
        """The final state, then on rank 0 the checkpoint (the best snapshot when selection ran), the
        report and provenance."""
        if self.steps_run:
            self._save_state(finished=self.step >= self.total)
        draft = self.snapshot()
        if self.dist.is_main:
            path = self.metrics_path
            if not self.final and path.is_file() and path.read_text().strip():
                self.final = json.loads(path.read_text().strip().splitlines()[-1])
            info = {**self.base, "step": self.step, "metrics": self.final}
            draft, info = self.selector.finish(draft, info)
            checkpoint.save_checkpoint(self.outdir, draft, info=info)
            selection.write_report(self.outdir, stall_fraction=self.stall_fraction,
                                   tokens_per_second=self.tokens_per_second)
            write_provenance(self.outdir, config=recipe or {"train": dataclasses.asdict(self.cfg)}, argv=argv,
                             inputs=inputs, extra={"world_size": self.dist.world_size,
                                                   "num_nodes": self.dist.num_nodes})
            log.info("saved draft checkpoint (step %d) to %s; data stall %.2f%% of loop time, %.0f tokens/s",
                     info["step"], self.outdir, 100 * self.stall_fraction, self.tokens_per_second)
        self.dist.barrier()


def _full_draft(objective, fresh_draft, dist: DistState) -> Eagle3Draft | None:
    """Rank 0: a plain draft holding the (gathered) current weights; other ranks: None."""
    if not dist.distributed:
        return objective.draft
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(objective, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_main:
        return None
    draft = fresh_draft()
    state = {k.removeprefix("draft."): v for k, v in full.items()}
    draft.load_state_dict(state, strict=True)
    return draft


def drop_oov_positions(batch, argmax: torch.Tensor, in_draft_vocab: torch.Tensor):
    """``train.oov_positions=drop`` (SpecForge's rule): a token whose target distribution (at the
    position before it) has its top-1 outside the draft vocabulary leaves the loss, at every TTT
    step. The default ``keep`` trains on the draft-vocab part of that distribution, renormalised."""
    keep = torch.ones_like(batch.loss_mask)
    keep[:, 1:] = in_draft_vocab[argmax[:, :-1]]
    return dataclasses.replace(batch, loss_mask=batch.loss_mask & keep)


def _check_target_agreement(batch, argmax: torch.Tensor) -> None:
    """Log how often the target head's argmax at t equals x_{t+1} on loss tokens (first batch).

    On-policy greedy features give ~1.0. A low value on such data means last_hidden is not what
    the head expects (e.g. captured after the final norm, as HF's hidden_states[L] is).
    """
    nxt = batch.loss_mask[:, 1:] & (batch.doc_ids[:, 1:] == batch.doc_ids[:, :-1])
    agree = (argmax[:, :-1] == batch.input_ids[:, 1:]) & nxt
    n = int(nxt.sum())
    if n:
        rate = int(agree.sum()) / n
        (log.info if rate >= 0.5 else log.warning)(
            "target head argmax == next token on %.1f%% of first-batch loss tokens%s", 100 * rate,
            "" if rate >= 0.5 else " (is last_hidden taken BEFORE the target's final norm?)")


def _summarise(window, *, step: int, epoch: int, lr: float, seconds: float, stall: float,
               tokens_per_second: float) -> dict[str, Any]:
    k = len(window[0]["step_count"])
    count = [sum(r["step_count"][i] for r in window) for i in range(k)]
    correct = [sum(r["step_correct"][i] for r in window) for i in range(k)]
    return {
        "step": step, "epoch": epoch, "lr": lr, "seconds": round(seconds, 2),
        "loss": sum(r["loss"] for r in window) / len(window),
        "step_loss": [sum(r["step_loss"][i] for r in window) / len(window) for i in range(k)],
        "step_acc": [c / n if n else 0.0 for c, n in zip(correct, count)],
        "step_count": [int(c) for c in count], "tokens": int(sum(r["tokens"] for r in window)),
        "stall_fraction": round(stall, 4),
        # Global training tokens per second of wall time since the last record (data waits included).
        "tokens_per_second": round(tokens_per_second, 1),
    }
