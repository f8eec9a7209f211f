"""One small CLI shape for every stage: ``<stage> <subcommand> [--recipe R] [key=value ...]``.

Each stage declares its subcommands as functions ``fn(recipe, args) -> int`` and calls
:func:`run`. User errors (:class:`EaglenestError`) become exit code 2 and one line on stderr.
Logging is configured here, once, and nowhere else. :func:`run` also starts the process guard
(:mod:`eaglenest.reaper`): whatever the command starts (engines, servers, workers) ends with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable

from eaglenest import reaper
from eaglenest.errors import EaglenestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    fn: Callable[..., int]
    help: str
    #: Extra arguments: list of (flags, kwargs) passed to ``add_argument``.
    args: list[tuple[tuple[str, ...], dict]] = field(default_factory=list)
    #: Whether the command loads the recipe (most do).
    needs_recipe: bool = True


def setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose == 0:
        logging.getLogger("eaglenest").setLevel(logging.INFO)


def run(prog: str, description: str, commands: dict[str, Command], argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in commands.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if cmd.needs_recipe:
            p.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/toy.yaml)")
            p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and stop")
            p.add_argument("overrides", nargs="*", metavar="section.key=value",
                           help="override any recipe key")
        p.add_argument("-v", "--verbose", action="count", default=0)
        for flags, kwargs in cmd.args:
            p.add_argument(*flags, **kwargs)
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    reaper.guard()  # engines and helpers end with this process, even under SIGKILL (common/reaper.py)
    cmd = commands[args.command]
    try:
        if not cmd.needs_recipe:
            return int(cmd.fn(None, args) or 0)
        from eaglenest.recipe import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            print(json.dumps(recipe.to_dict(), indent=2, sort_keys=True))
            return 0
        return int(cmd.fn(recipe, args) or 0)
    except EaglenestError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
