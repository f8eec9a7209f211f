"""``train run`` / ``train launch``: train an EAGLE-3 draft from the run's feature store.

``train run`` works as a plain process and under ``torchrun --nproc-per-node N -m
eaglenest.pipeline.train_cli run ...`` (FSDP2, see docs/training.md). ``train launch --nproc N ...`` is
the same as that torchrun line: it starts torchrun with this interpreter and waits for it.

The command lives above the stages because ``train.select_every_steps`` scores snapshots by serving
them (export and evaluate come after train); the trainer itself imports neither.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys

from eaglenest.cli import Command, run


def _run(recipe, args) -> int:
    from eaglenest.evaluate.cli import evaluate_config  # served-AL selection renders as evaluate does
    from eaglenest.pipeline.select import served_al_scorer
    from eaglenest.train.loop import train

    main_rank = os.environ.get("RANK", "0") == "0"
    if not main_rank:  # torchrun: one rank reports
        logging.getLogger("eaglenest").setLevel(logging.WARNING)
    r = recipe.run
    score = None
    if recipe.train.select_every_steps:
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


def _launch(recipe, args) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "eaglenest.pipeline.train_cli", "run"]
    if args.recipe:
        cmd += ["--recipe", args.recipe]
    cmd += list(args.overrides) + ["-v"] * args.verbose
    return subprocess.call(cmd)


COMMANDS = {
    "run": Command(_run, "train a draft head on the features table (TTT objective)"),
    "launch": Command(_launch, "run `train run` under torchrun with --nproc ranks (FSDP2)",
                      args=[(("--nproc",), {"type": int, "default": 2, "help": "ranks (processes)"})]),
}


def main(argv: list[str] | None = None) -> int:
    return run("train", "Train EAGLE-3 draft heads from the feature store.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
