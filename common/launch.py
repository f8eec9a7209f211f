"""Running a parsed command: what every eaglenest command does between its arguments and its body.

:func:`execute` sets up logging (here, once, and nowhere else), lets ``kill -USR1`` dump every
thread's stack, starts the process guard (:mod:`eaglenest.reaper`: whatever the command starts,
engines, servers, workers, ends with it), loads and validates the recipe, registers the store's
options for this process, remembers where vLLM should log (written only when an engine starts:
:func:`eaglenest.engine.defer_quiet_vllm`), and calls the command's body, imported only now. User
errors (:class:`EaglenestError`) become exit code 2 and one line on stderr. ``eaglenest.cli``
parses the arguments and imports this module only once they are accepted.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import signal
import sys
from typing import Callable

from eaglenest import reaper
from eaglenest.engine import defer_quiet_vllm
from eaglenest.errors import EaglenestError
from eaglenest.recipe import load_recipe


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


def resolve(fn: Callable[..., int] | str) -> Callable[..., int]:
    """A command body, imported now if named as ``"module:function"``."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def execute(prog: str, cmd, args: argparse.Namespace) -> int:
    """Run ``cmd`` (an ``eaglenest.cli.Command``) on the parsed ``args``; the exit code."""
    setup_logging(args.verbose)
    dump_stacks_on_sigusr1()
    reaper.guard()  # engines and helpers end with this process, even under SIGKILL (common/reaper.py)
    try:
        if not cmd.needs_recipe:
            return int(resolve(cmd.fn)(None, args) or 0)
        recipe = load_recipe(args.recipe, args.overrides)
        recipe.run.register_storage()  # the store's options, for this process only (runconfig.py)
        if args.dry_run:
            print(json.dumps(recipe.to_dict(), indent=2, sort_keys=True))
            return 0
        # Where vLLM's INFO lines go; nothing is written until an engine starts (engine.quiet_vllm), so a
        # command that refuses its input leaves the workdir as it was.
        defer_quiet_vllm(recipe.run.path("logs"), args.verbose)
        # Imported only now: a bad recipe costs no heavy import.
        return int(resolve(cmd.fn)(recipe, args) or 0)
    except EaglenestError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
