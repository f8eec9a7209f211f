"""The trainer: pinned features -> draft vocab -> TTT training with AdamW -> checkpoint.

Single process. Everything that makes a run differ is explicit: the table version (resolved and
pinned into provenance), the seed (init, sample order, packing) and the config. Determinism on
CPU: same seed, same thread count -> the same weights bit for bit (checked by a test).
For FSDP2 the model needs ``fully_shard(model.midlayer)`` then ``fully_shard(model)`` and a
sampler that splits the batch plan by rank; nothing here is a process-global.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from eaglenest.provenance import write_provenance
from eaglenest.errors import SchemaError
from eaglenest.train import checkpoint, vocab as V
from eaglenest.train.config import TrainConfig
from eaglenest.train.data import PackedData, read_split
from eaglenest.train.model import Eagle3Draft, draft_config, init_weights
from eaglenest.train.target import load_target_tensors
from eaglenest.train.ttt import TargetHead, target_targets, ttt_loss

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainSummary:
    outdir: Path
    steps: int
    table_version: int
    final: dict[str, Any]


def build_draft(cfg: TrainConfig, target: dict[str, Any], *, layer_ids: tuple[int, ...],
                vocab: V.DraftVocab, seed: int) -> Eagle3Draft:
    """A freshly initialised draft with the target's embeddings and the vocab maps set."""
    dcfg = draft_config(target["config"], draft_vocab_size=vocab.size,
                        layer_ids=tuple(sorted(layer_ids)), flags=cfg.flags())
    model = Eagle3Draft(dcfg)
    init_weights(model, seed=seed)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target["embed"])
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
    return model


def lr_factor(step: int, *, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def train(cfg: TrainConfig, *, store_uri: str, workdir: str, target_dir: str, seed: int,
          argv: list[str] | None = None, recipe: dict[str, Any] | None = None) -> TrainSummary:
    """Train a draft on ``store_uri``'s features and write ``<workdir>/<output_subdir>/``."""
    from tqdm import tqdm

    seed = cfg.seed if cfg.seed is not None else seed
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(seed)
    table, meta, version = read_split(store_uri, version=cfg.table_version, split=cfg.split)
    target = load_target_tensors(target_dir)
    if meta.hidden_size != target["config"]["hidden_size"]:
        raise SchemaError(f"features were captured with hidden size {meta.hidden_size}, "
                          f"run.target {target_dir} has {target['config']['hidden_size']}")
    vocab_size = int(target["config"]["vocab_size"])
    counts = V.count_loss_tokens(table.select(["input_ids", "loss_mask"]).to_batches(), vocab_size)
    vocab = V.select_vocab(counts, cfg.draft_vocab_size)
    log.info("features v%d: %d rows, %d loss tokens; draft vocab %d covers %.1f%% of them",
             version, table.num_rows, int(counts.sum()), vocab.size, 100 * V.coverage(counts, vocab))

    model = build_draft(cfg, target, layer_ids=meta.layer_ids, vocab=vocab, seed=seed)
    head = TargetHead(target["norm"], target["lm_head"], target["rms_norm_eps"])
    draft_target_ids = torch.from_numpy(vocab.draft_ids)
    data = PackedData(table, meta, pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=seed)
    plans = [data.plan(e) for e in range(cfg.num_epochs)]
    total = sum(len(p) for p in plans)
    if cfg.num_steps:
        total = min(total, cfg.num_steps)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(
        s, total=total, warmup=cfg.warmup_steps, min_ratio=cfg.min_lr_ratio))

    outdir = Path(workdir) / cfg.output_subdir
    outdir.mkdir(parents=True, exist_ok=True)
    metrics_path = outdir / "metrics.jsonl"
    metrics_path.write_text("", encoding="utf-8")
    step, window, final = 0, [], {}
    start = time.monotonic()
    bar = tqdm(total=total, desc="train", unit="step", disable=None)
    model.train()
    for epoch, plan in enumerate(plans):
        for rows in plan:
            if step >= total:
                break
            batch = data.collate(rows)
            probs, argmax = target_targets(head, batch.last_hidden, draft_target_ids)
            if step == 0:
                _check_target_agreement(batch, argmax)
            res = ttt_loss(model, batch, probs, argmax, num_steps=cfg.ttt_steps, step_decay=cfg.step_decay)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            res.loss = res.loss.detach()  # the log window must not keep graphs alive
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            window.append(res)
            if step % cfg.log_every_steps == 0 or step == total:
                final = _summarise(window, step=step, epoch=epoch, lr=sched.get_last_lr()[0],
                                   seconds=time.monotonic() - start)
                window = []
                with metrics_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(final) + "\n")
                log.info("step %d/%d loss %.4f acc %s", step, total, final["loss"],
                         " ".join(f"{a:.2f}" for a in final["step_acc"]))
                bar.set_postfix(loss=f"{final['loss']:.3f}", acc0=f"{final['step_acc'][0]:.2f}")
            bar.update(1)
    bar.close()

    info = {"step": step, "table_version": version, "store_uri": store_uri, "target": target_dir,
            "layer_ids": list(sorted(meta.layer_ids)), "feature_meta": json.loads(meta.to_json()),
            "train_config": dataclasses.asdict(cfg), "seed": seed, "metrics": final,
            "vocab_coverage": V.coverage(counts, vocab)}
    checkpoint.save_checkpoint(outdir, model, info=info)
    write_provenance(outdir, config=recipe or {"train": dataclasses.asdict(cfg)}, argv=argv,
                     inputs={"store_uri": store_uri, "table": "features", "version": version,
                             "target": target_dir})
    log.info("saved draft checkpoint (step %d) to %s", step, outdir)
    return TrainSummary(outdir=outdir, steps=step, table_version=version, final=final)


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


def _summarise(window, *, step: int, epoch: int, lr: float, seconds: float) -> dict[str, Any]:
    k = len(window[0].step_count)
    count = [sum(r.step_count[i] for r in window) for i in range(k)]
    correct = [sum(r.step_correct[i] for r in window) for i in range(k)]
    return {
        "step": step, "epoch": epoch, "lr": lr, "seconds": round(seconds, 2),
        "loss": sum(float(r.loss) for r in window) / len(window),
        "step_loss": [sum(r.step_loss[i] for r in window) / len(window) for i in range(k)],
        "step_acc": [c / n if n else 0.0 for c, n in zip(correct, count)],
        "step_count": count,
    }
