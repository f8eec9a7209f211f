"""One small CLI shape for every stage: ``<stage> <subcommand> [--recipe R] [key=value ...]``
(options and overrides in any order).

Each stage declares its subcommands in an argument table of :class:`Command` and calls :func:`run`.
A subcommand's body is a function ``fn(recipe, args) -> int`` or, for every body that pulls in
more than the standard library, a string ``"eaglenest.<stage>.<module>:<function>"`` imported only
when it runs; the string is an import edge ``tests/test_layering.py`` reads. This module parses the
arguments and nothing else, so ``--help`` and a mistyped option cost only argparse: running the
parsed command (logging, the process guard, the recipe, the one-line errors) is
:func:`eaglenest.launch.execute`, imported once the arguments are accepted.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int of at least ``low`` (argparse turns the ValueError into a usage error)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"int >= {low}"
    return parse


def path_arg(text: str) -> Path:
    """An argparse ``type``: a path, refusing an empty one (``--out "$DIR"`` with ``DIR`` unset), which
    ``Path`` would read as the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)


path_arg.__name__ = "path"


def path_text(text: str) -> str:
    """:func:`path_arg` for an option whose body takes the text typed (``--out``, ``--draft``): an empty one
    is refused, not read as the option's default (``args.out or <default>``)."""
    path_arg(text)
    return text


path_text.__name__ = "path"


def did_you_mean(typed: str, known) -> str:
    """``"; did you mean X?"`` naming the closest of ``known`` to ``typed`` (an option's ``=value`` left out),
    or ``""`` when none is close."""
    close = difflib.get_close_matches(typed.split("=", 1)[0], list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse that refuses bad input in one line (README: exit 2, one line naming the problem), not its
    usage block, and names the closest command to a mistyped one; ``--help`` prints the usage as before."""

    def error(self, message: str):
        typed = re.search(r"argument COMMAND: invalid choice: (['\"])(.*?)\1 \(choose", message)
        commands = [c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
        hint = did_you_mean(typed.group(2), commands) if typed else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


@dataclass(frozen=True)
class Command:
    #: ``fn(recipe, args) -> int``, or ``"module:function"`` naming it (imported when the command runs).
    fn: Callable[..., int] | str
    help: str
    #: Extra arguments: list of (flags, kwargs) passed to ``add_argument``.
    args: list[tuple[tuple[str, ...], dict]] = field(default_factory=list)
    #: Whether the command loads the recipe (most do).
    needs_recipe: bool = True


def run(prog: str, description: str, commands: dict[str, Command], argv: list[str] | None = None) -> int:
    parser = Parser(prog=prog, description=description)
    # -v before the command's name too (``ingest -v build``): its own name, as the command's default
    # (0) would overwrite a count stored under ``verbose``; the two are added below.
    parser.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_before",
                        help="more logging (also after COMMAND)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subparsers = {}
    for name, cmd in commands.items():
        p = subparsers[name] = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if cmd.needs_recipe:
            p.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/toy.yaml)")
            p.add_argument("--dry-run", action="store_true", help="print the resolved recipe and stop")
            p.add_argument("overrides", nargs="*", metavar="section.key=value",
                           help="override any recipe key")
        p.add_argument("-v", "--verbose", action="count", default=0)
        for flags, kwargs in cmd.args:
            p.add_argument(*flags, **kwargs)
    # What the command ran with (its provenance records it); a library caller's paths are words, as
    # subprocess takes them.
    argv = sys.argv[1:] if argv is None else [os.fspath(a) if isinstance(a, os.PathLike) else a for a in argv]
    # Options may come before or after the overrides (``al key=v --out D k2=v2``): argparse stops
    # the positional list at the first option, so overrides after an option are picked up here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if getattr(args, "overrides", None) is None or any(x.startswith("-") or "=" not in x for x in extra):
            flag = next((x for x in extra if x.startswith("--")), "")  # the first mistyped option: its closest
            parser.error(f"unrecognized arguments: {' '.join(extra)}"
                         + (did_you_mean(flag, subparsers[args.command]._option_string_actions) if flag else ""))
        args.overrides = [*args.overrides, *extra]
    args.verbose += args.verbose_before
    # Everything past parsing lives in eaglenest.launch (the recipe, the engine plumbing, the process
    # guard): imported only now, so --help never pays for it. Named by string like the command bodies.
    return importlib.import_module("eaglenest.launch").execute(prog, commands[args.command], args, argv)
