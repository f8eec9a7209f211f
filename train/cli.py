"""``train run``: train an EAGLE-3 draft from the run's feature store (see docs/training.md)."""

from __future__ import annotations

import sys

from eaglenest.cli import Command, run


def _run(recipe, args) -> int:
    from eaglenest.train.loop import train

    r = recipe.run
    summary = train(recipe.train, store_uri=r.store_uri, workdir=r.workdir, target_dir=r.target,
                    seed=r.seed, argv=sys.argv, recipe=recipe.to_dict())
    print(f"draft checkpoint: {summary.outdir} (step {summary.steps}, features v{summary.table_version})")
    return 0


COMMANDS = {"run": Command(_run, "train a draft head on the features table (TTT objective)")}


def main(argv: list[str] | None = None) -> int:
    return run("train", "Train EAGLE-3 draft heads from the feature store.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
