"""One small CLI shape for every stage: ``<stage> <subcommand> [--recipe R] [key=value ...]``
(options and overrides in any order).

Each stage declares its subcommands as functions ``fn(recipe, args) -> int`` and calls
:func:`run`. A subcommand whose module pulls in heavy libraries (torch, Lance, vLLM) is named as
``"eaglenest.<stage>.<module>:<function>"`` instead, imported only when it runs (after the recipe
is loaded), so ``--help`` starts fast; the string is an import edge ``tests/test_layering.py``
reads. User errors (:class:`EaglenestError`) become exit code 2 and one line on stderr.
Logging is configured here, once, and nowhere else. :func:`run` also starts the process guard
(:mod:`eaglenest.reaper`): whatever the command starts (engines, servers, workers) ends with it.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Callable

from eaglenest import reaper
from eaglenest.engine import defer_quiet_vllm
from eaglenest.errors import EaglenestError
from eaglenest.recipe import load_recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    #: ``fn(recipe, args) -> int``, or ``"module:function"`` naming it (imported when the command runs).
    fn: Callable[..., int] | str
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


def dump_stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every thread's Python stack to stderr (a stuck job can be asked
    where it is without a debugger); the process goes on."""
    if not hasattr(signal, "SIGUSR1"):
        return
    for stream in (sys.stderr, sys.__stderr__):  # sys.stderr may be captured in memory (an in-process call)
        try:
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
            return
        except (AttributeError, OSError, ValueError, RuntimeError):  # no file descriptor behind it
            continue


def _resolve(fn: Callable[..., int] | str) -> Callable[..., int]:
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


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
    # Options may come before or after the overrides (``al key=v --out D k2=v2``): argparse stops
    # the positional list at the first option, so overrides after an option are picked up here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "overrides", None) is None or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    setup_logging(args.verbose)
    dump_stacks_on_sigusr1()
    reaper.guard()  # engines and helpers end with this process, even under SIGKILL (common/reaper.py)
    cmd = commands[args.command]
    try:
        if not cmd.needs_recipe:
            return int(_resolve(cmd.fn)(None, args) or 0)
        recipe = load_recipe(args.recipe, args.overrides)
        recipe.run.register_storage()  # the store's options, for this process only (runconfig.py)
        if args.dry_run:
            print(json.dumps(recipe.to_dict(), indent=2, sort_keys=True))
            return 0
        # Where vLLM's INFO lines go; nothing is written until an engine starts (engine.quiet_vllm), so a
        # command that refuses its input leaves the workdir as it was.
        defer_quiet_vllm(recipe.run.path("logs"), args.verbose)
        # Imported only now: a bad recipe costs no heavy import.
        return int(_resolve(cmd.fn)(recipe, args) or 0)
    except EaglenestError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
