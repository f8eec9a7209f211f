"""The model card (``README.md``) of the long-context tiny target.

Like ``card``: only measured numbers, passed in from the build (the same numbers go to
provenance.json), so the card cannot claim what the build did not measure.
"""

from __future__ import annotations

from pathlib import Path


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def bucket_table(buckets: dict[str, dict], ratios: dict[str, float]) -> str:
    """Markdown table: per bucket confidence [95% interval], ratio to 1K, answers, far-context figures."""
    lines = ["| bucket | prompt tokens | prompts | target_confidence [95%] | / 1K | answers found | "
             "far kept | far removed | difference | answer value kept | far removed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(buckets, key=int):
        f = buckets[b]
        ci = f["intervals"].get("target_confidence")
        conf = f"{f['target_confidence']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
        far = f["far_context"]
        lines.append(f"| {int(b) // 1024}K | {f['prompt_tokens']} | {f['prompts']} | {conf} | {ratios[b]:.3f} | "
                     f"{f['answer_found']} | {_fmt(far.get('confidence_kept'))} | "
                     f"{_fmt(far.get('confidence_far_removed'))} | {_fmt(far.get('difference'))} | "
                     f"{_fmt(far.get('answer_value_kept'))} | {_fmt(far.get('answer_value_removed'))} |")
    return "\n".join(lines)


def copy_table(probe: dict[str, dict]) -> str:
    """Markdown table of ``longeval.copy_probe``: per row kind and length, loss and accuracy."""
    lines = ["| rows | tokens | loss | accuracy |", "|---|---|---|---|"]
    for kind, by_len in sorted(probe.items()):
        for n, f in sorted(by_len.items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {kind} | {n} | {f['loss']:.3f} | {f['accuracy']:.3f} |")
    return "\n".join(lines)


def phases_text(phases: list[tuple[str, str]]) -> str:
    """The phases of a recipe build, ``(name, what it changes)`` each (empty for a one-phase build)."""
    if not phases:
        return ""
    lines = ["In phases, one after another on the same model, each with a fresh optimizer and schedule "
             "(the settings above unless the phase changes them):", ""]
    lines += [f"- `{name}`: {changed or 'nothing'}" for name, changed in phases]
    return "\n".join(lines) + "\n\n"


def write_long_card(outdir: str | Path, *, cfg, metrics: dict, seeds: dict, base_metrics: dict,
                    phases: list[tuple[str, str]] = (), root_base: str = "", base_rope_theta: float | None = None,
                    recipe_flags: str = "") -> Path:
    root_base = root_base or cfg.base  # the model the whole build started from (a resumed build's differs)
    was = f" (the base's: {base_rope_theta:g})" if base_rope_theta else ""
    train, buckets = metrics["train"], metrics["buckets"]
    stages = "\n".join(f"| {s.get('phase', 'train')} | {s['seq_len_tokens']} | {s['batch_size']} | {s['num_steps']} | {s['seconds']:.0f} | "
                       f"{s['final_loss']:.3f} | {s['final_answer_loss']:.3f} |" for s in train["stages"])
    base_held = base_metrics.get("held_out", {})
    held = "\n".join(f"| {d} | {_fmt(base_held.get(d, {}).get('loss'))} | {s['loss']:.3f} | "
                     f"{_fmt(base_held.get(d, {}).get('top1_accuracy'))} | {s['top1_accuracy']:.3f} |"
                     for d, s in metrics["held_out"].items())
    stages_arg = ",".join(f"{s['seq_len_tokens']}x{s['batch_size']}x{s['num_steps']}"
                          + (f"x{s['sample_tokens']}" if s.get("sample_tokens") else "")
                          + (":" + "+".join(s["kinds"]) if s.get("kinds") else "") for s in train["stages"])
    if cfg.phases:
        rebuild = (f"python -m eaglenest.tinytarget.long --recipe {cfg.recipe or 'RECIPE.yaml'} --out assets/tiny-target-long "
                   f"--seed {cfg.seed} --base {root_base}" + (f" {recipe_flags}" if recipe_flags else ""))
        if cfg.from_phase:
            rebuild += (f"\n# this folder: resumed at phase {cfg.from_phase} (--from-phase {cfg.from_phase}) from "
                        f"{cfg.base}, the output of the phases before it; the result is the same")
    else:
        rebuild = (f"python -m eaglenest.tinytarget.long --out assets/tiny-target-long --base {root_base} "
                   f"--seed {cfg.seed} --rope-theta {cfg.rope_theta:g} \\\n"
                   f"    --skip-fraction {cfg.skip_fraction} --stages {stages_arg} \\\n"
                   f"    --answer-weight {cfg.answer_weight:g} --token-weight {cfg.token_weight:g} --weight-decay {cfg.weight_decay:g} "
                   f"--adam-beta2 {cfg.adam_beta2:g} --warmup-steps {cfg.warmup_steps} --peak-lr {cfg.peak_lr:g} "
                   f"--min-lr-ratio {cfg.min_lr_ratio:g} --row-kinds {','.join(cfg.row_kinds)}")
    if train.get("resumed_at"):
        took = (f"resumed at phase `{train['resumed_at']}`, the rest of the build (its phases, measurement, writing) "
                f"took **{metrics['build_seconds']:.0f} s** on this machine (the earlier phases' seconds are in the table)")
    else:
        took = f"the whole build (training, measurement, writing) took **{metrics['build_seconds']:.0f} s** on this machine"
    text = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [eaglenest, test-fixture, synthetic, long-context]
---

# eaglenest tiny target, long context

The tiny target (`{root_base}`, trained on 256-token rows) continued to work at up to
{cfg.max_positions} tokens: same shape, tokenizer and chat format, RoPE base {cfg.rope_theta:g}{was}.
A test fixture for long-context drafting; it knows only eaglenest's toy domains.
`docs/long_context.md` says what was tried and why this recipe.

## Long-context measurement

The buckets of `evaluate al` (`evaluate.buckets`, seed 0, material `records, code, recall, chat`,
{cfg.eval_prompts_per_bucket} prompts per bucket), decoded greedily for up to 64 tokens with
transformers. `target_confidence`: mean probability of the model's own output tokens (95% interval:
bootstrap over the bucket's prompts; few prompts, so a sketch, not a measurement; `evaluate al
--recipe recipes/long_eval.yaml` has 16). `answers found`: outputs holding the reference answer
(records, code, recall). Far context: the first 8 output tokens scored with the whole prompt (kept)
and after only its last 512 tokens (removed), as `evaluate/farctx.py` does; `answer value`: the
reference answer's value tokens (the record's field, the helper's name, the stated fact: what only
the far evidence holds) teacher-forced after the whole prompt and after its last 512 tokens.

{bucket_table(buckets, metrics["confidence_ratio_to_1k"])}

Copy from context (`longeval.copy_probe`, held-out rows): loss in nats per marked token (uniform
guessing: ln of the vocabulary, 7.6) and top-1 accuracy; `repeat`: a random span repeated, `copy`:
a random span repeated once, far apart, within corpus text.

{copy_table(metrics.get("copy_probe", {}))}

## Short prompts (held-out corpus, assistant tokens)

| domain | base loss | loss | base top-1 | top-1 |
|---|---|---|---|---|
{held}

## Training

Continued from `{root_base}` with AdamW (betas 0.9/{cfg.adam_beta2:g}, weight decay {cfg.weight_decay}), peak lr
{cfg.peak_lr}, {cfg.warmup_steps} warmup steps then one cosine to {cfg.min_lr_ratio} x peak over the
stages. Rows: long material of `evaluate.longctx`'s kinds (records, code, recall) with its answer,
and short corpus documents packed long ({cfg.raw_fraction:.0%} raw text), round-robin; loss =
{cfg.token_weight:g} x mean token loss + {cfg.answer_weight} x mean loss on the answer tokens. {cfg.skip_fraction:.0%} of rows have
skipped position ids (one random gap, reaching up to {cfg.max_positions}). {cfg.num_threads} CPU thread(s).

{phases_text(list(phases))}| phase | row tokens | rows / step | steps | seconds | loss (last quarter) | answer loss |
|---|---|---|---|---|---|---|
{stages}

{train['tokens_seen']} tokens in {train['train_seconds']:.0f} s of training; {took}.

Seeds: {", ".join(f"{k} {v}" for k, v in seeds.items())}. The training prompts' seeds and the
evaluation's never meet (`eaglenest.tinytarget.longdata.TRAIN_SEED_BASE`).

## Rebuild

```bash
{rebuild}
```

`provenance.json` records the code version, package versions, configuration and every number above
(per-prompt rows included).
"""
    path = Path(outdir) / "README.md"
    path.write_text(text, encoding="utf-8")
    return path
