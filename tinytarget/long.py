"""``python -m eaglenest.tinytarget.long``: the long-context tiny target (competent at 32K tokens).

Continues the committed tiny target (``assets/tiny-target``, trained on 256-token rows) with:

1. RoPE base raised from 1e4 to ``rope_theta`` (1e6; the "adjusted base frequency" recipe): the
   slowest rotary dimensions then turn less than a radian over 32K positions, so far positions look
   like moderately far ones instead of aliasing;
2. a length curriculum (``stages``, real tokens per row and optionally several shorter prompts
   packed per row) on a mix of long material with answers (``longdata``: registries, modules, long
   chats, training seeds) and short corpus documents packed long, the loss weighing the answer
   tokens extra;
3. skipped positions (``longdata.skipped_positions``) on a fraction of rows, so relative distances
   up to 32K are trained while attention costs only the row's real length (on one CPU thread a
   32K row's forward and backward take minutes, an 8K row's about 11 s, a 2K row's about 1 s).

A recipe (``--recipe``, ``recipes/tiny_target/long.yaml``) runs several such curricula as
phases on the same model, each with its own training settings, optimizer and schedule: the
copy circuit forms only under settings the later phases must not keep (run X in the docs).

Then measures it on the evaluation's long-context buckets (``longeval``) and the short held-out set,
and writes a Hugging Face folder with ``README.md`` and ``provenance.json``. Seeded, one thread:
a rebuild on the same software stack gives the same weights. No recipe tried so far reaches the
issue's goal (docs/long_context.md has the figures); the defaults are the best one measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import shutil
import sys
import time
from pathlib import Path

from eaglenest.cli import Command, path_arg
from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.evaluate import longctx
from eaglenest.evaluate.buckets import bucket_lengths, check_generated
from eaglenest.launch import execute
from eaglenest.paths import check_output_dir, read_json_object, staged_dir
from eaglenest.provenance import write_provenance
from eaglenest.tinytarget import corpus, longdata, longeval, train
from eaglenest.tinytarget.build import _add_legacy_dtype, is_model_folder
from eaglenest.tinytarget.longcard import write_long_card
from eaglenest.tinytarget.longconfig import (EVAL_MATERIAL_SEED, PHASE_KEYS, REQUIRED_TOKENIZER_FILES,
                                                TOKENIZER_FILES, LongConfig, format_stages, load_recipe, parse_stages,
                                                show_setting)

log = logging.getLogger(__name__)

#: Prompts of each long kind made per prompt size before training: a size that some seeds' questions
#: and evidence do not fit is refused then, not at the row that meets it (a code prompt of 208 tokens
#: fails for about one seed in five). From 1024 tokens on every kind fits many times over: one is made.
CHECK_PROMPTS = 64
CHECK_ALL_BELOW_TOKENS = 1024


def check_material(hf_tok, cfg: LongConfig) -> None:
    """Make the long prompts the stages' rows and the evaluation's shortest bucket will need, so a
    stage or bucket too short for its material is refused before the stages before it train."""
    first_stage = {}
    for _, phase_cfg in cfg.training_phases():
        for stage in phase_cfg.stages:
            for kind in stage.kinds or phase_cfg.row_kinds:
                if kind in longctx.KINDS:
                    first_stage.setdefault((stage.sample_tokens or stage.seq_len_tokens, kind), stage)
    for (size, kind), stage in first_stage.items():
        for i in range(CHECK_PROMPTS if size < CHECK_ALL_BELOW_TOKENS else 1):
            try:
                longctx.generate(kind, hf_tok, size - longdata.ANSWER_ROOM, seed=longdata.TRAIN_SEED_BASE + i)
            except ConfigError:
                raise ConfigError(f"stages: {format_stages((stage,))}: {size} tokens is too short for a {kind} "
                                  f"prompt and its answer; give its rows (or packed prompts) more tokens") from None
    try:
        lengths = bucket_lengths(cfg.eval_buckets, max_positions=cfg.max_positions,
                                 max_tokens=longeval.MAX_NEW_TOKENS)
        check_generated(hf_tok, lengths, kinds=longeval.KINDS, per_bucket=cfg.eval_prompts_per_bucket)
    except ConfigError as exc:
        raise ConfigError(f"eval_buckets: {exc}") from None


#: Weights files a --base may hold (transformers' names).
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def check_base(base: str) -> None:
    """Refuse a --base that is no model folder with its tokenizer, before any work."""
    path = Path(base)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--base: no model at {base}")
    read_json_object(path / "config.json", error=ConfigError, then=f"--base: {base} is not a model folder")
    missing = [n for n in REQUIRED_TOKENIZER_FILES if not (path / n).is_file()]
    if missing:  # the output copies them after training: refuse before, not after, the hours
        raise ConfigError(f"--base: {base} has no {', '.join(missing)} (the tokenizer the build copies)")
    if not any((path / n).is_file() for n in WEIGHTS_FILES):
        raise ConfigError(f"--base: {base} has no weights ({', '.join(WEIGHTS_FILES)})")
    _provenance(base)  # read for the card after training: a broken one is refused now


def lr_at(step: int, cfg: LongConfig) -> float:
    """Linear warmup, then one cosine over all stages down to ``min_lr_ratio * peak_lr``."""
    return train.lr_at(step, train.TrainConfig(num_steps=cfg.num_steps, peak_lr=cfg.peak_lr,
                                               min_lr_ratio=cfg.min_lr_ratio, warmup_steps=cfg.warmup_steps))


def load_base(cfg: LongConfig):
    """The base model with its RoPE base replaced by ``cfg.rope_theta`` and its context by
    ``cfg.max_positions`` (sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(cfg.base)
    config.rope_parameters = {**(config.rope_parameters or {}), "rope_theta": float(cfg.rope_theta),
                              "rope_type": "default"}
    config.max_position_embeddings = cfg.max_positions  # what the build trains and measures up to
    return AutoModelForCausalLM.from_pretrained(cfg.base, config=config, attn_implementation="sdpa")


def train_long(model, hf_tok, cfg: LongConfig, *, first_row: int = 0, phase: str = "train") -> dict:
    """Train ``model`` in place through the curriculum of one phase (``cfg.stages``), its rows
    seeded from ``first_row`` on; returns per-stage losses and timing."""
    import torch

    rng = random.Random(f"longpos:{cfg.seed}:{phase}" if phase != "train" else f"longpos:{cfg.seed}")
    material = longdata.chat_material(corpus.generate(longdata.NUM_MATERIAL, seed=cfg.seed))
    docs = longdata.DocStream(hf_tok, seed=cfg.seed, raw_fraction=cfg.raw_fraction)
    opt = train.optimizer(model, peak_lr=cfg.peak_lr, weight_decay=cfg.weight_decay, beta2=cfg.adam_beta2)
    model.train()
    step, stats, start, row0 = 0, [], time.perf_counter(), first_row
    for stage in cfg.stages:
        t0, losses, ans_losses = time.perf_counter(), [], []
        for _ in range(stage.num_steps):
            batch = list(longdata.rows(hf_tok, stage.seq_len_tokens, stage.batch_size, first_row=first_row,
                                       material=material, docs=docs, sample_tokens=stage.sample_tokens,
                                       kinds=stage.kinds or cfg.row_kinds))
            first_row += stage.batch_size
            ids = torch.tensor([b[0] for b in batch])
            mask = torch.tensor([b[1] for b in batch], dtype=torch.float32)[:, 1:]
            pos = torch.tensor([longdata.skipped_positions(stage.seq_len_tokens, cfg.max_positions, rng)
                                if rng.random() < cfg.skip_fraction else list(range(stage.seq_len_tokens))
                                for _ in batch])
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            logits = model(input_ids=ids, position_ids=pos).logits[:, :-1]
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                   reduction="none").view_as(mask)
            ans = (ce * mask).sum() / mask.sum().clamp(min=1)
            loss = cfg.token_weight * ce.mean() + cfg.answer_weight * ans
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(ce.mean().item())
            ans_losses.append(ans.item())
            step += 1
            if step % 10 == 0:
                log.info("step %d/%d (%d tokens): loss %.3f answer loss %.3f", step, cfg.num_steps,
                         stage.seq_len_tokens, losses[-1], ans_losses[-1])
        tail = max(1, len(losses) // 4)  # mean over the stage's last quarter: one row per step is noisy
        stats.append({**dataclasses.asdict(stage), "phase": phase, "seconds": round(time.perf_counter() - t0, 1),
                      "final_loss": round(sum(losses[-tail:]) / tail, 4),
                      "final_answer_loss": round(sum(ans_losses[-tail:]) / tail, 4)})
    model.eval()
    return {"stages": stats, "train_seconds": round(time.perf_counter() - start, 1), "rows": first_row - row0,
            "tokens_seen": sum(s.seq_len_tokens * s.batch_size * s.num_steps for s in cfg.stages),
            "train_prompt_seeds": [longdata.TRAIN_SEED_BASE + row0, longdata.TRAIN_SEED_BASE + first_row - 1]}


def train_phases(model, hf_tok, cfg: LongConfig, *, phase_dir: Path | None = None) -> dict:
    """Every phase of ``cfg`` in turn on ``model``; the long prompts' seeds run on across phases
    (no prompt is trained twice), each phase has a fresh optimizer and schedule. With ``phase_dir``
    each finished phase's model is saved to ``phase_dir/NAME``, the ``--base`` of a build resumed
    at the next phase (``--from-phase``)."""
    stats, seconds, tokens, first_row = [], 0.0, 0, 0
    phases = cfg.training_phases()
    names = [n for n, _ in phases]
    earlier = _base_metrics(cfg.base).get("train", {}).get("stages", []) if cfg.from_phase else []
    for name, phase_cfg in phases:
        if cfg.from_phase and names.index(name) < names.index(cfg.from_phase):
            first_row += sum(s.batch_size * s.num_steps for s in phase_cfg.stages)  # trained in --base
            continue
        if name != "train":
            log.info("phase %s: %s", name, format_stages(phase_cfg.stages))
        out = train_long(model, hf_tok, phase_cfg, first_row=first_row, phase=name)
        first_row += out["rows"]
        stats += out["stages"]
        seconds += out["train_seconds"]
        tokens += out["tokens_seen"]
        if phase_dir is not None and cfg.phases:
            _save_phase(model, phase_dir / name, cfg, name, [*earlier, *stats])
            later = names[names.index(name) + 1:]
            if later:
                log.info("phase %s saved: resume with --from-phase %s --base %s", name, later[0], phase_dir / name)
    # A resumed build's record is the whole build's: the earlier phases' stages (from the base's own
    # provenance) first, their seconds and tokens counted in
    seconds += sum(s["seconds"] for s in earlier)
    tokens += sum(s["seq_len_tokens"] * s["batch_size"] * s["num_steps"] for s in earlier)
    out = {"stages": [*earlier, *stats], "train_seconds": round(seconds, 1), "rows": first_row, "tokens_seen": tokens,
           "train_prompt_seeds": [longdata.TRAIN_SEED_BASE, longdata.TRAIN_SEED_BASE + first_row - 1]}
    if cfg.from_phase:
        out["resumed_at"] = cfg.from_phase
    return out


def _save_phase(model, out: Path, cfg: LongConfig, name: str, stages: list[dict]) -> None:
    """A finished phase's model with a provenance whose training record a resumed build reads."""
    with staged_dir(out, "--phase-dir", replaces=is_model_folder, error=ConfigError) as tmp:
        save(model, tmp, cfg)
        write_provenance(tmp, config=dataclasses.asdict(cfg), inputs={"base": cfg.base, "phase": name},
                         extra={"metrics": {"train": {"stages": stages}}})


def measure(model, hf_tok, cfg: LongConfig) -> dict:
    """Long-context buckets (``longeval``) and the short held-out set (``train.evaluate_domains``)."""
    held = corpus.generate(max(64, cfg.num_held_out), seed=EVAL_MATERIAL_SEED)
    buckets = longeval.measure(model, hf_tok, longdata.chat_material(held[:64]), buckets=cfg.eval_buckets,
                               per_bucket=cfg.eval_prompts_per_bucket, max_positions=cfg.max_positions)
    docs = longdata.DocStream(hf_tok, seed=EVAL_MATERIAL_SEED, raw_fraction=cfg.raw_fraction)
    return {"buckets": buckets, "confidence_ratio_to_1k": longeval.ratio_to_first(buckets),
            "copy_probe": longeval.copy_probe(model, hf_tok, docs),
            "held_out": train.evaluate_domains(model, hf_tok, held[:cfg.num_held_out])}


def save(model, out: Path, cfg: LongConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    attn = model.config._attn_implementation
    model.config._attn_implementation = None  # not part of the published config
    model.save_pretrained(str(out))
    model.config._attn_implementation = attn  # a model saved between phases trains on as before
    _add_legacy_dtype(out / "config.json")
    for name in TOKENIZER_FILES:
        if (Path(cfg.base) / name).is_file():  # the required ones were checked before training
            shutil.copyfile(Path(cfg.base) / name, out / name)


def build(out: Path, cfg: LongConfig, *, phase_dir: Path | None = None) -> dict:
    """Train, measure and write the long-context target to ``out``; returns the metrics. With
    ``phase_dir``, each finished phase is saved there too (``train_phases``)."""
    import torch
    from transformers import AutoTokenizer

    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    hf_tok = AutoTokenizer.from_pretrained(cfg.base)
    model = load_base(cfg)
    train_stats = train_phases(model, hf_tok, cfg, phase_dir=phase_dir)
    metrics = {"train": train_stats, **measure(model, hf_tok, cfg)}
    with staged_dir(out, "--out", replaces=is_model_folder, error=ConfigError) as tmp:  # whole or not at all
        save(model, tmp, cfg)
        metrics["build_seconds"] = round(time.perf_counter() - start, 1)
        write_outputs(tmp, cfg, metrics, seeds=_seeds(cfg, train_stats))
    return metrics


def _seeds(cfg: LongConfig, train_stats: dict) -> dict:
    return {"corpus_and_recall_turns": cfg.seed,
             "train_prompts": f"evaluate.longctx seeds {train_stats['train_prompt_seeds'][0]}.."
                              f"{train_stats['train_prompt_seeds'][1]} (packed prompts: "
                              f"{longdata.PACKED_SEED_BASE} + 64 x (seed - {longdata.TRAIN_SEED_BASE}) + j)",
             "positions": f"longpos:{cfg.seed}",
             "eval_prompts": "evaluate.buckets seed 0 (evaluate al's engine.seed=0)",
             "eval_material_and_held_out": EVAL_MATERIAL_SEED}


def write_outputs(out: Path, cfg: LongConfig, metrics: dict, *, seeds: dict) -> None:
    """The model card and ``provenance.json`` beside the weights."""
    root = root_base(cfg)
    write_long_card(out, cfg=cfg, metrics=metrics, seeds=seeds, base_metrics=_base_metrics(root), root_base=root,
                    base_rope_theta=_rope_theta(root), recipe_flags=recipe_flags(cfg),
                    phases=[(ph.name, ", ".join(f"{k} {show_setting(v)}" for k, v in ph.settings)) for ph in cfg.phases])
    write_provenance(out, config=dataclasses.asdict(cfg), inputs={"base": cfg.base, "root_base": root, "seeds": seeds},
                     extra={"metrics": metrics})


def root_base(cfg: LongConfig) -> str:
    """The model the whole build started from. A resumed build's ``--base`` holds the earlier
    phases (a saved phase or a build of the recipe cut after them): its own provenance names the
    model those started from, followed back through builds that were themselves resumed."""
    base, resumed = cfg.base, bool(cfg.from_phase)
    for _ in range(len(cfg.phases) + 1):
        if not resumed:
            return base
        config = _provenance(base).get("config") or {}
        if not config.get("base"):
            return base  # not a build of this command: the base is all there is to name
        base, resumed = config["base"], bool(config.get("from_phase"))
    return base


#: The keys of a build's metrics that ``measure`` produces (what ``--remeasure`` replaces).
MEASURED = ("buckets", "confidence_ratio_to_1k", "copy_probe", "held_out")


def measure_saved(path: Path, cfg: LongConfig) -> dict:
    """``measure`` on the model saved at ``path`` (sdpa attention, ``cfg.num_threads`` threads)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(cfg.num_threads)
    model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()
    return measure(model, AutoTokenizer.from_pretrained(str(path)), cfg)


def remeasure(out: Path, cfg: LongConfig) -> dict:
    """Measure the build at ``out`` again with this code (after the measurement changed) and rewrite
    its card and provenance; the weights and the training figures stay. ``cfg`` must be the
    configuration it was built with (the same recipe and flags)."""
    path = out / "provenance.json"
    if not path.is_file():
        raise ConfigError(f"--remeasure: {out} has no provenance.json (not a build of this command)")
    prov = read_json_object(path, error=ConfigError, then="--remeasure needs the build's own record")
    built, mine = prov.get("config") or {}, json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    differ = sorted(k for k in set(built) | set(mine) if built.get(k) != mine.get(k))
    if differ or "train" not in (prov.get("metrics") or {}):
        raise ConfigError(f"--remeasure: {out} was built with other settings ({', '.join(differ) or 'no training record'}); "
                          "give the recipe and flags it was built with")
    start = time.perf_counter()
    metrics = {k: v for k, v in prov["metrics"].items() if k not in MEASURED}
    metrics.update(measure_saved(out, cfg))
    metrics["remeasured"] = {"seconds": round(time.perf_counter() - start, 1),
                             "built_by": prov.get("code_version"), "built_unix": prov.get("created_unix")}
    write_outputs(out, cfg, metrics, seeds=(prov.get("inputs") or {}).get("seeds") or {})
    return metrics


def _provenance(model: str) -> dict:
    """A model folder's provenance.json (empty when absent)."""
    path = Path(model) / "provenance.json"
    if not path.is_file():
        return {}
    return read_json_object(path, error=ConfigError, then="the build reads the model's record there: restore it "
                                                          "or remove it")


def _rope_theta(model: str) -> float | None:
    """A model folder's RoPE base from its config.json (None when it has none)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # only the card's mention of it is lost
        return None
    return (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))


def _base_metrics(base: str) -> dict:
    """The base model's short held-out figures, from its provenance.json (empty when absent)."""
    return _provenance(base).get("metrics", {})


#: Command-line flags of LongConfig fields: (flag, field, type, help).
FLAGS = (
    ("--base", "base", str, "model to continue from"),
    ("--seed", "seed", int, "training seed (not the evaluation's 0 / 7919)"),
    ("--rope-theta", "rope_theta", float, "RoPE base of the long model"),
    ("--skip-fraction", "skip_fraction", float, "rows with skipped positions"),
    ("--stages", "stages", parse_stages, "curriculum, TOKENSxROWSxSTEPS[xPACKED][:KIND+...] per stage"),
    ("--answer-weight", "answer_weight", float, "extra loss weight of answers"),
    ("--token-weight", "token_weight", float, "weight of the mean loss over all tokens (0: the answers alone)"),
    ("--weight-decay", "weight_decay", float, "AdamW's, on the matrices"),
    ("--adam-beta2", "adam_beta2", float, "AdamW's second-moment decay"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps"),
    ("--peak-lr", "peak_lr", float, "peak learning rate"),
    ("--min-lr-ratio", "min_lr_ratio", float, "the cosine's end as a fraction of --peak-lr (1: constant after warmup)"),
    ("--row-kinds", "row_kinds", lambda t: tuple(k for k in t.split(",") if k),
     f"training row kinds, round-robin (of {','.join(longdata.ALL_KINDS)}; repeatN: repeat over N tokens)"),
    ("--eval-prompts", "eval_prompts_per_bucket", int, "prompts per bucket"),
    ("--eval-buckets", "eval_buckets", lambda t: tuple(int(b) for b in t.split(",")), "bucket lengths"),
)


def recipe_flags(cfg: LongConfig) -> str:
    """The flags a ``--recipe`` build was given beside its recipe (its settings that differ from the
    recipe file's top level; ``--base`` and ``--seed`` the card names anyway), for the rebuild line."""
    if not cfg.recipe:
        return ""
    try:
        recipe = LongConfig(**load_recipe(cfg.recipe))
    except (EaglenestError, OSError) as exc:  # the recipe moved or changed since (a --remeasure)
        log.warning("the card's rebuild line cannot name flags given beside %s: %s", cfg.recipe, exc)
        return ""
    return " ".join(f"{flag} {show_setting(getattr(cfg, field))}" for flag, field, _, _ in FLAGS
                    if field not in ("base", "seed") and getattr(cfg, field) != getattr(recipe, field))


def _flag_value(flag: str, kind, text: str):
    """``text`` of ``flag`` as its field holds it; what does not parse is an error naming the flag."""
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{flag}: cannot read {text!r}") from None


def _check_overridden(kwargs: dict) -> None:
    """A training setting given for the whole build (recipe top level or flag) that every phase sets
    itself would never be trained: refused, not ignored."""
    phases = kwargs.get("phases") or ()
    unused = sorted(k for k in kwargs if k in PHASE_KEYS and phases and all(k in dict(p.settings) for p in phases))
    if unused:
        raise ConfigError(f"{', '.join(unused)}: every phase of the recipe sets its own, so the build's is never "
                          "used; change it in the phases")


def check_phase_dir(phase_dir: Path | None, cfg: LongConfig) -> None:
    """Each phase's folder under ``--phase-dir`` is one the build can write, checked before training."""
    if phase_dir is None:
        return
    if not cfg.phases:
        raise ConfigError("--phase-dir: this build has no phases to save (give a --recipe with phases)")
    for phase in cfg.phases:
        check_output_dir(phase_dir / phase.name, "--phase-dir", replaces=is_model_folder, error=ConfigError)


def check_resume(cfg: LongConfig) -> None:
    """A build resumed at ``cfg.from_phase`` claims the whole build's result: its ``--base`` must hold
    exactly the recipe's phases before that one, stage for stage (its provenance says which it trained)."""
    if not cfg.from_phase:
        return
    before = cfg.training_phases()[:[p.name for p in cfg.phases].index(cfg.from_phase)]
    want = [(name, _stage_key(dataclasses.asdict(s))) for name, phase_cfg in before for s in phase_cfg.stages]
    have = [(s.get("phase"), _stage_key(s)) for s in _base_metrics(cfg.base).get("train", {}).get("stages", [])]
    if have != want:
        trained = ", ".join(dict.fromkeys(str(n) for n, _ in have)) or "none"
        raise ConfigError(f"--from-phase {cfg.from_phase}: --base {cfg.base} is not the output of the recipe's "
                          f"phases before it (its training record holds phases: {trained})")


def _stage_key(stage: dict) -> tuple:
    return (stage.get("seq_len_tokens"), stage.get("batch_size"), stage.get("num_steps"),
            stage.get("sample_tokens", 0), tuple(stage.get("kinds") or ()))


def _tokenizer(base: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)


PROG = "python -m eaglenest.tinytarget.long"


def main(argv: list[str] | None = None) -> int:
    d = LongConfig()
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=path_arg, default=Path("assets/tiny-target-long"), help="model folder")
    p.add_argument("--recipe", type=path_arg, default=None,
                   help="YAML of the build's settings and its phases (recipes/tiny_target/long.yaml); "
                        "flags given beside it override its top-level settings")
    for flag, field, _, text in FLAGS:
        default = getattr(d, field)
        shown = format_stages(default) if field == "stages" else \
            ",".join(map(str, default)) if isinstance(default, tuple) else default
        p.add_argument(flag, default=None, help=f"{text} (default {shown})")
    p.add_argument("--from-phase", default=None,
                   help="resume a --recipe build at this phase, --base being the output of the phases before it")
    p.add_argument("--measure-only", action="store_true",
                   help="measure --base as it is (no training, nothing written) and print the figures")
    p.add_argument("--phase-dir", type=path_arg, default=None,
                   help="save each finished phase of a --recipe build to DIR/NAME (resume a stopped build "
                        "with --from-phase NEXT --base DIR/NAME)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the build at --out again (same recipe and flags) and rewrite its card and "
                        "provenance; weights and training figures stay")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    args = p.parse_args(argv)
    # The shared CLI layer: logging, the process guard, one-line errors (exit 2), Ctrl-C and SIGTERM
    # unwinding through the staged folder's cleanup, as every stage command does.
    return execute(PROG, Command(fn=run, help=p.description, needs_recipe=False), args)


def run(recipe: None, args: argparse.Namespace) -> int:
    """The command's body: resolve and check the settings, then build, measure or measure again."""
    try:
        cfg = _settings(args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.measure_only:
        print(json.dumps(measure_saved(Path(cfg.base), cfg), indent=1))
        return 0
    if args.remeasure:
        metrics = remeasure(Path(args.out), cfg)
        log.info("measured %s again; confidence / 1K: %s", args.out, metrics["confidence_ratio_to_1k"])
        return 0
    metrics = build(args.out, cfg, phase_dir=args.phase_dir)
    log.info("wrote %s in %.0f s; confidence / 1K: %s", args.out, metrics["build_seconds"],
             metrics["confidence_ratio_to_1k"])
    return 0


def _settings(args: argparse.Namespace) -> LongConfig:
    """The build's settings from --recipe and the flags, checked before any training."""
    d = LongConfig()
    kwargs = load_recipe(args.recipe) if args.recipe is not None else {}
    if args.from_phase:
        if args.base is None:
            raise ConfigError("--from-phase: give --base, the output of the phases before it")
        kwargs["from_phase"] = args.from_phase
    for flag, field, kind, _ in FLAGS:
        value = getattr(args, field if field not in ("eval_prompts_per_bucket",) else "eval_prompts")
        if value is not None:
            kwargs[field] = _flag_value(flag, kind, value)
    _check_overridden(kwargs)
    if kwargs.get("seed", d.seed) in (0, EVAL_MATERIAL_SEED):
        raise ConfigError(f"--seed: {kwargs['seed']} is a seed of the evaluation material; pick another")
    cfg = LongConfig(**kwargs)
    check_base(cfg.base)
    if not (args.measure_only or args.remeasure):  # likewise a --out it could not write in the end
        check_output_dir(args.out, "--out", replaces=is_model_folder, error=ConfigError)
        check_phase_dir(args.phase_dir, cfg)
        check_resume(cfg)
    check_material(_tokenizer(cfg.base), cfg)
    return cfg

if __name__ == "__main__":
    sys.exit(main())
