"""The trainer: pinned features -> draft vocab -> TTT training with AdamW -> checkpoint.

One code path for a plain process and for torchrun (FSDP2 over a gloo/nccl group, see
:mod:`eaglenest.train.dist`). Every rank builds the same global batch plan and trains on its rows
of each global batch; losses are normalised by GLOBAL per-step token counts, so the ranks' losses
and gradients sum to exactly the 1-rank ones (FSDP2 averages gradients, hence ``loss * world``).
Everything that makes a run differ is explicit: the table version (pinned in provenance and
state), the seed (init, sample order, packing) and the config. Same seed, same thread count ->
the same weights bit for bit, also across a SIGKILL and ``train.resume=auto``
(:mod:`eaglenest.train.state`). Served-AL selection's books and the report live in
:mod:`eaglenest.train.select`; the scorer, which serves the draft, is passed in from above the
stages (:mod:`eaglenest.pipeline.select`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from eaglenest.errors import SchemaError
from eaglenest.provenance import write_provenance
from eaglenest.train import checkpoint, select, state as S, vocab as V
from eaglenest.train.config import TrainConfig
from eaglenest.train.data import FeatureShards, Prefetcher
from eaglenest.train.dist import DistState
from eaglenest.train.model import Eagle3Draft, draft_config, init_weights, num_parameters
from eaglenest.train.target import load_target_tensors
from eaglenest.train.ttt import TargetHead, TTTObjective, target_targets, valid_counts

log = logging.getLogger(__name__)


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


def attention_span(cfg: TrainConfig, lengths) -> int:
    """``train.sliding_window`` in positions: "auto" is the longest span a training query attends
    over (the longest sample, truncated at ``pack_tokens``); 0 means no window."""
    if cfg.sliding_window == "auto":
        return int(min(max((int(n) for n in lengths), default=cfg.pack_tokens), cfg.pack_tokens))
    return int(cfg.sliding_window)


def build_draft(cfg: TrainConfig, target: dict[str, Any], *, layer_ids: tuple[int, ...],
                vocab: V.DraftVocab, seed: int, sliding_window: int = 0) -> Eagle3Draft:
    """A freshly initialised draft with the target's embeddings and the vocab maps set.
    ``sliding_window``: positions the draft attends over (0: all; see :func:`attention_span`)."""
    dcfg = draft_config(target["config"], draft_vocab_size=vocab.size,
                        layer_ids=tuple(sorted(layer_ids)), flags=cfg.flags(),
                        sliding_window=sliding_window, shape=cfg.draft.shape())
    dcfg.attn_chunk_tokens = int(cfg.attn_chunk_tokens)
    model = Eagle3Draft(dcfg)
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


def lr_factor(step: int, *, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def train(cfg: TrainConfig, *, store_uri: str, workdir: str, target_dir: str, seed: int,
          argv: list[str] | None = None, recipe: dict[str, Any] | None = None,
          score=None, dist: DistState | None = None, featurestore=None,
          target_keys: dict[str, str] | None = None, off_policy: bool = False,
          trust_remote_code: bool = False) -> TrainSummary:
    """Train a draft on ``store_uri``'s features and write ``<workdir>/<output_subdir>/``.

    ``target_keys``: ``run.target_keys`` (where the target's embed/norm/lm_head are); ``off_policy``:
    ``run.off_policy`` (train on features of responses another target generated).
    ``score``: served-AL scorer for ``train.select_every_steps`` (snapshot dir -> ``{"served_al",
    "prompts"}``; :func:`eaglenest.pipeline.select.served_al_scorer`). ``featurestore``: its
    FeaturestoreConfig, used by ``train.source=stream`` (capture engine, layer ids). ``dist``: default
    joins torchrun's process group when launched by torchrun (and leaves it at the end).
    """
    select.require_scorer(cfg, score)
    own = dist is None
    dist = dist or DistState.from_env()
    try:
        return _train(cfg, store_uri=store_uri, workdir=workdir, target_dir=target_dir, seed=seed,
                      argv=argv, recipe=recipe, score=score, dist=dist, featurestore=featurestore,
                      target_keys=target_keys, off_policy=off_policy, trust_remote_code=trust_remote_code)
    finally:
        if own:
            dist.close()


def _train(cfg, *, store_uri, workdir, target_dir, seed, argv, recipe, score, dist,
           featurestore=None, target_keys=None, off_policy=False, trust_remote_code=False) -> TrainSummary:
    from tqdm import tqdm

    seed = cfg.seed if cfg.seed is not None else seed
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(seed)
    # The feature set to train on: the table the recipe's capture writes (featurestore.table).
    table = getattr(featurestore, "table", None) or "features"
    if cfg.source == "stream":  # hook: a live capture engine instead of the table (train/stream_source.py)
        from eaglenest.train.stream_source import StreamShards

        data = StreamShards(store_uri, featurestore=featurestore, target=target_dir, split=cfg.split,
                            pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=seed,
                            depth=cfg.stream_depth, devices=cfg.stream_devices, trust_remote_code=trust_remote_code)
    else:
        data = FeatureShards(store_uri, version=cfg.table_version, split=cfg.split, table=table,
                             pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=seed)
    meta, version = data.meta, data.version
    from eaglenest.featurestore import policy

    policy.check_features(meta, target_dir, off_policy=off_policy, stage="train run")
    policy.check_prompts(store_uri, target_dir, off_policy=off_policy, stage="train run")
    target = load_target_tensors(target_dir, keys=target_keys)
    if meta.hidden_size != target["config"]["hidden_size"]:
        raise SchemaError(f"features were captured with hidden size {meta.hidden_size}, "
                          f"run.target {target_dir} has {target['config']['hidden_size']}")
    # Draft vocabulary: one SQL aggregate over the pinned table version (featurestore.query).
    if cfg.source == "stream":
        counts = data.loss_token_counts(int(target["config"]["vocab_size"]))
    else:
        counts = V.count_loss_tokens_in_store(store_uri, version=version, split=cfg.split, table=table,
                                              vocab_size=int(target["config"]["vocab_size"]))
    vocab = V.select_vocab(counts, cfg.draft_vocab_size)
    log.info("features v%d: %d rows, %d loss tokens; draft vocab %d covers %.1f%% of them",
             version, data.num_rows, int(counts.sum()), vocab.size, 100 * V.coverage(counts, vocab))

    attn_window = attention_span(cfg, data.lengths)
    if attn_window:
        log.info("draft attention window: %d positions (train.sliding_window=%s)", attn_window, cfg.sliding_window)

    def fresh_draft() -> Eagle3Draft:
        return build_draft(cfg, target, layer_ids=meta.layer_ids, vocab=vocab, seed=seed,
                           sliding_window=attn_window)

    first = fresh_draft()
    num_params = num_parameters(first)
    log.info("draft: %s parameters (hidden %d, heads %d/%d x %d, MLP %d, draft vocab %d)",
             f"{num_params:,}", first.config.hidden_size, first.config.num_attention_heads,
             first.config.num_key_value_heads, first.config.head_dim, first.config.intermediate_size, vocab.size)
    objective = dist.shard(TTTObjective(first).to(dist.device), param_dtype=cfg.param_dtype)
    head = TargetHead(target["norm"], target["lm_head"], target["rms_norm_eps"]).to(dist.device)
    draft_target_ids = torch.from_numpy(vocab.draft_ids).to(dist.device)
    in_draft_vocab = vocab.t2d.to(dist.device)
    schedule = [(e, rows) for e in range(cfg.num_epochs) for rows in data.plan(e)]
    total = min(len(schedule), cfg.num_steps) if cfg.num_steps else len(schedule)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, total=total, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio))

    outdir = Path(workdir) / cfg.output_subdir
    state_dir = outdir / "state"
    fp = S.fingerprint(cfg, table_version=version, store_uri=store_uri, target=target_dir, seed=seed,
                       table=table)
    dist.check_shared_dir(outdir)  # each rank writes its DCP shard there (docs/training.md, "Multi-node")
    # Rank 0's view of the latest state decides for all (another node's cache might lag behind).
    latest = S.read_latest(state_dir) if cfg.resume == "auto" and dist.is_main else None
    info = S.resolve(dist.broadcast_object(latest), fp, state_dir)
    if info is not None:
        S.load_state(info, objective=objective, opt=opt, sched=sched, dist=dist)
    elif dist.is_main:
        shutil.rmtree(state_dir, ignore_errors=True)
    step = info["step"] if info else 0
    window = info.get("window", []) if info else []
    dist.barrier()
    selector = select.Selector(outdir, cfg=cfg, score=score, target_dir=target_dir, active=dist.is_main,
                               resume_step=step)
    metrics_path = outdir / "metrics.jsonl"
    if dist.is_main:
        outdir.mkdir(parents=True, exist_ok=True)
        select.truncate_jsonl(metrics_path, step)

    base = {"table": table, "table_version": version, "store_uri": store_uri, "target": target_dir,
            "layer_ids": list(sorted(meta.layer_ids)), "feature_meta": json.loads(meta.to_json()),
            "train_config": dataclasses.asdict(cfg), "seed": seed, "vocab_coverage": V.coverage(counts, vocab),
            "world_size": dist.world_size, "num_parameters": num_params, "target_keys": target["keys"]}

    def snapshot() -> Eagle3Draft | None:
        """The current weights as a plain draft on rank 0 (a collective under FSDP2)."""
        return _full_draft(objective, fresh_draft, dist)

    if cfg.source == "stream":
        data.start(schedule[step:total], world_size=dist.world_size)
    loader = Prefetcher(data, schedule[step:total], rank=dist.rank, world_size=dist.world_size,
                        depth=cfg.prefetch_batches)
    start, final, tokens_seen, steps_run = time.monotonic(), {}, 0.0, 0
    loop_t0, last_t, last_wait = time.perf_counter(), time.perf_counter(), 0.0
    bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=None if dist.is_main else True)
    objective.train()
    try:
        for epoch, rows, batch, ghost in loader:
            if ghost:
                batch.loss_mask = torch.zeros_like(batch.loss_mask)
            batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(dist.device)
                                                  for f in dataclasses.fields(batch)})
            probs, argmax = target_targets(head, batch.last_hidden, draft_target_ids,
                                           chunk_tokens=cfg.target_chunk_tokens)
            if step == 0 and dist.is_main:
                _check_target_agreement(batch, argmax)
            if cfg.oov_positions == "drop":
                batch = drop_oov_positions(batch, argmax, in_draft_vocab)
            denoms = dist.all_reduce_sum(valid_counts(batch, cfg.ttt_steps))
            res = objective(batch, probs, argmax, num_steps=cfg.ttt_steps, step_decay=cfg.step_decay,
                            denominators=denoms, chunk_tokens=cfg.target_chunk_tokens)
            opt.zero_grad(set_to_none=True)
            (res.loss * dist.world_size).backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            steps_run += 1
            k = cfg.ttt_steps
            local_tokens = 0 if ghost else int((batch.doc_ids >= 0).sum())
            g = dist.all_reduce_sum([float(res.loss.detach()), *res.step_loss, *res.step_correct, local_tokens])
            tokens_seen += g[-1]
            window.append({"loss": g[0], "step_loss": g[1:1 + k], "step_correct": g[1 + k:1 + 2 * k],
                           "step_count": denoms, "tokens": g[-1]})
            if step % cfg.log_every_steps == 0 or step == total:
                now = time.perf_counter()
                stall = (loader.wait_seconds - last_wait) / max(now - last_t, 1e-9)
                final = _summarise(window, step=step, epoch=epoch, lr=sched.get_last_lr()[0],
                                   seconds=time.monotonic() - start, stall=stall)
                last_t, last_wait, window = now, loader.wait_seconds, []
                if dist.is_main:
                    with metrics_path.open("a", encoding="utf-8") as f:
                        f.write(json.dumps(final) + "\n")
                    log.info("step %d/%d loss %.4f acc %s stall %.1f%%", step, total, final["loss"],
                             " ".join(f"{a:.2f}" for a in final["step_acc"]), 100 * stall)
                bar.set_postfix(loss=f"{final['loss']:.3f}", acc0=f"{final['step_acc'][0]:.2f}")
            bar.update(1)
            if cfg.select_every_steps and (step % cfg.select_every_steps == 0 or step == total):
                selector.evaluate(step, snapshot(), info={**base, "step": step, "metrics": final})
                dist.barrier()
            if step < total and cfg.state_every_steps and step % cfg.state_every_steps == 0:
                S.save_state(state_dir, step=step, objective=objective, opt=opt, sched=sched, dist=dist,
                             fp=fp, extra={"window": window, "finished": False}, keep=cfg.keep_states)
    finally:
        loader.close()
        bar.close()
        data.close()  # the stream's engine, or the table reader and its version pin
    loop_s = time.perf_counter() - loop_t0
    stall_fraction = loader.wait_seconds / loop_s if steps_run else 0.0
    tps = tokens_seen / loop_s if steps_run else 0.0
    if steps_run:
        S.save_state(state_dir, step=step, objective=objective, opt=opt, sched=sched, dist=dist,
                     fp=fp, extra={"window": window, "finished": step >= total}, keep=cfg.keep_states)
    draft = snapshot()
    if dist.is_main:
        if not final and metrics_path.is_file() and metrics_path.read_text().strip():
            final = json.loads(metrics_path.read_text().strip().splitlines()[-1])
        info_out = {**base, "step": step, "metrics": final}
        draft, info_out = selector.finish(draft, info_out)  # the best snapshot when selection ran
        checkpoint.save_checkpoint(outdir, draft, info=info_out)
        select.write_report(outdir, stall_fraction=stall_fraction, tokens_per_second=tps)
        write_provenance(outdir, config=recipe or {"train": dataclasses.asdict(cfg)}, argv=argv,
                         inputs={"store_uri": store_uri, "version": version,
                                 "table": table if cfg.source == "table" else "prompts (streamed)",
                                 "target": target_dir},
                         extra={"world_size": dist.world_size, "num_nodes": dist.num_nodes})
        log.info("saved draft checkpoint (step %d) to %s; data stall %.2f%% of loop time, %.0f tokens/s",
                 info_out["step"], outdir, 100 * stall_fraction, tps)
    dist.barrier()
    return TrainSummary(outdir=outdir, steps=step, table_version=version, final=final,
                        stall_fraction=stall_fraction, tokens_per_second=tps, num_parameters=num_params)


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


def _summarise(window, *, step: int, epoch: int, lr: float, seconds: float, stall: float) -> dict[str, Any]:
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
    }
