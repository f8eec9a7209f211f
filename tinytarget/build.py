"""``eaglenest-tiny-target``: build the tiny target LLM fixture (corpus -> tokenizer -> model).

Writes a Hugging Face model folder (config, fp32 safetensors, tokenizer, generation config, model
card, provenance.json) that vLLM and transformers load offline, plus the demo's prompt files
(``recipes/data/<domain>.jsonl``, drawn with a different seed). ``--prompts-only`` writes just
the prompt files. Run from the repository root; paths are relative to the working directory. The
model folder is written whole or not at all: built beside ``--out`` and renamed into place, an
earlier model there replaced only once the new one is complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from eaglenest.cli import Command, path_arg
from eaglenest.errors import ConfigError
from eaglenest.launch import execute
from eaglenest.paths import check_output_dir, make_dir, staged_dir
from eaglenest.provenance import write_provenance
from eaglenest.tinytarget import corpus, tokenizer, train
from eaglenest.tinytarget.card import write_model_card
from eaglenest.tinytarget.prompts import PROMPT_SEED, write_prompt_files
from eaglenest.tinytarget.train import ModelShape, TrainConfig

log = logging.getLogger(__name__)

NUM_EVAL_PER_DOMAIN = 100
NUM_GREEDY_PER_DOMAIN = 8
EVAL_SEED_OFFSET = 7919  # held-out samples: a seed the training corpus never uses


def build(out: Path, *, shape, cfg) -> dict:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.num_threads)
    samples = corpus.generate(cfg.num_train_samples, seed=cfg.seed)
    texts = [corpus.to_raw_text(s) for s in samples] + [s["system"] for s in samples if s.get("system")]
    tok = tokenizer.train_tokenizer(texts, vocab_size=shape.vocab_size)
    tokenizer.save_hf_tokenizer(tok, out, model_max_length=shape.max_position_embeddings)
    tokenizer.check_hf_tokenizer(out)
    hf_tok = AutoTokenizer.from_pretrained(str(out))

    rows = train.pack(train.render_documents(samples, hf_tok, raw_fraction=cfg.raw_fraction,
                                             seed=cfg.seed), cfg.seq_len_tokens)
    ids = tokenizer.special_ids(tok)
    model = LlamaForCausalLM(train.llama_config(shape, ids))
    num_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, %d packed rows", num_params / 1e6, len(rows))
    train_stats = train.train(model, rows, cfg)

    held_out = corpus.generate(NUM_EVAL_PER_DOMAIN * len(corpus.DOMAINS),
                               seed=cfg.seed + EVAL_SEED_OFFSET)
    eval_stats = train.evaluate_domains(model, hf_tok, held_out)
    greedy_stats, examples = {}, {}
    for d in corpus.DOMAINS:
        picks = [s for s in held_out if s["domain"] == d][:NUM_GREEDY_PER_DOMAIN]
        results = [train.greedy_chat(model, hf_tok, s) for s in picks]
        greedy_stats[d] = {
            "stop_rate": sum(stop for _, stop in results) / len(results),
            "exact_rate": sum(t == s["response"] for (t, _), s in zip(results, picks)) / len(results)}
        examples[d] = f"{picks[0]['prompt']}\n---\n{results[0][0]}"
        log.info("%s: %s greedy %s", d, eval_stats[d], greedy_stats[d])

    model.save_pretrained(str(out))
    _add_legacy_dtype(out / "config.json")
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=ids["pad_token_id"]).save_pretrained(str(out))
    write_model_card(out, shape=shape, cfg=cfg, num_params=num_params,
                     tokenizer_vocab=tok.get_vocab_size(), train_stats=train_stats,
                     eval_stats=eval_stats, greedy_stats=greedy_stats, samples=examples)
    metrics = {"num_params": num_params, "tokenizer_vocab": tok.get_vocab_size(),
               "train": train_stats, "held_out": eval_stats, "greedy": greedy_stats,
               "greedy_examples": examples}
    write_provenance(out, config={"shape": dataclasses.asdict(shape), "train": dataclasses.asdict(cfg)},
                     inputs={"corpus": f"eaglenest.tinytarget.corpus seed={cfg.seed}",
                             "held_out": f"seed={cfg.seed + EVAL_SEED_OFFSET}"},
                     extra={"metrics": metrics})
    return metrics


def _add_legacy_dtype(path: Path) -> None:
    """transformers 5 writes ``dtype``; older readers look for ``torch_dtype``. Write both."""
    config = json.loads(path.read_text())
    config["torch_dtype"] = config["dtype"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


PROG = "eaglenest-tiny-target"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=path_arg, default=Path("assets/tiny-target"), help="model folder")
    p.add_argument("--prompts-out", type=path_arg, default=Path("recipes/data"),
                   help="folder for <domain>.jsonl prompt files")
    p.add_argument("--steps", type=int, default=TrainConfig().num_steps, help="optimizer steps")
    p.add_argument("--seed", type=int, default=TrainConfig().seed, help="training seed")
    p.add_argument("--prompt-seed", type=int, default=PROMPT_SEED, help="seed of the prompt files")
    p.add_argument("--prompts-only", action="store_true", help="write the prompt files and stop")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv: debug)")
    args = p.parse_args(argv)
    # The shared CLI layer: logging, the process guard, one-line errors (exit 2), Ctrl-C and SIGTERM
    # unwinding through the staged folder's cleanup, as every stage command does.
    return execute(PROG, Command(fn=run, help=p.description, needs_recipe=False), args)


def run(recipe: None, args: argparse.Namespace) -> int:
    """The command's body: check the flags, write the prompt files, build the model into ``--out``."""
    _check_flags(args)
    if not args.prompts_only:  # before the prompt files: nothing written for a refused --out
        check_output_dir(args.out, "--out", replaces=is_model_folder, error=ConfigError)
        _check_apart(args.prompts_out, args.out)
    write_prompt_files(make_dir(args.prompts_out, "--prompts-out", error=ConfigError), seed=args.prompt_seed)
    if args.prompts_only:
        return 0
    cfg = TrainConfig(seed=args.seed, num_steps=args.steps)
    try:
        with staged_dir(args.out, "--out", replaces=is_model_folder, error=ConfigError) as tmp:
            metrics = build(tmp, shape=ModelShape(), cfg=cfg)
    except OSError as exc:  # a disk that filled up while writing: the earlier --out is as it was
        raise ConfigError(f"writing failed ({exc.strerror or exc}); {args.out} unchanged") from None
    log.info("wrote %s (%.1f s training)", args.out, metrics["train"]["train_seconds"])
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    if args.steps < 1:
        raise ConfigError("--steps must be >= 1")
    if not 0 <= args.seed < train.MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.prompt_seed == args.seed:
        raise ConfigError("--prompt-seed must differ from --seed")


def _check_apart(prompts_out: Path, out: Path) -> None:
    """The model folder is replaced whole: prompt files written inside it would go with the old one."""
    prompts, model = prompts_out.resolve(), out.resolve()
    if prompts == model or model in prompts.parents:
        raise ConfigError(f"--prompts-out: {prompts_out} is inside --out {out} (replaced whole by the build); "
                          "give a folder outside it")


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` holds a model this command may replace (a Hugging Face ``config.json``)."""
    return (path / "config.json").is_file()


if __name__ == "__main__":
    sys.exit(main())
