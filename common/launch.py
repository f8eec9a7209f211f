"""Running a parsed command: what every eaglenest command does between its arguments and its body.

:func:`execute` sets up logging (here, once, and nowhere else), lets ``kill -USR1`` dump every
thread's stack, starts the process guard (:mod:`eaglenest.reaper`: whatever the command starts,
engines, servers, workers, ends with it), loads and validates the recipe, registers the store's
options for this process, remembers where vLLM should log (written only when an engine starts:
:func:`eaglenest.engine.defer_quiet_vllm`), and calls the command's body, imported only now. User
errors (:class:`EaglenestError`) become exit code 2 and one line on stderr. A SIGTERM (``kill``, a
scheduler's stop, torchrun stopping its other ranks) unwinds like Ctrl-C, so the same cleanup runs (an
import's uncommitted new table is removed, engines are closed), then the process ends by that SIGTERM
(its parent sees it signalled, as before). ``eaglenest.cli`` parses the arguments and imports this
module only once they are accepted.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import logging
import os
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


class Terminated(KeyboardInterrupt):
    """A SIGTERM, raised in the main thread where it lands: every ``except BaseException`` /
    ``KeyboardInterrupt`` cleanup path runs for it as for Ctrl-C."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM during the cleanup ends the process at once
    raise Terminated()


def unwind_on_sigterm() -> bool:
    """Make a SIGTERM raise :class:`Terminated`; False (nothing changed) off the main thread or where
    the host program has its own SIGTERM handler."""
    if not hasattr(signal, "SIGTERM") or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    try:
        signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread of the main interpreter
        return False
    return True


def end_by_sigterm(prog: str) -> int:
    """After the cleanup: end the process by SIGTERM's default action, as if no handler had been set."""
    print(f"{prog}: terminated", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    return 128 + signal.SIGTERM  # not reached (the signal is delivered before os.kill returns)


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
    ours = unwind_on_sigterm()
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
    except Terminated:
        return end_by_sigterm(prog)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if ours and signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
