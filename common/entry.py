"""What the console scripts (``[project.scripts]``) run: a command's CLI module, imported inside the guard.

A console script imports its ``main`` before calling it, and a command's CLI module takes a few tenths of a
second to import (the CLI plumbing, the recipe loader): a Ctrl-C then printed a ``KeyboardInterrupt``
traceback, where one a moment later ends the command with ``<command>: interrupted`` and by SIGINT
(``eaglenest.launch``; a shell sees 130). :func:`enter` imports the module and runs its ``main`` under one
``except KeyboardInterrupt`` that ends the same way. It imports only the standard library, so the guard is up
a few milliseconds after the interpreter starts. The entry points themselves name the stage modules from the
layer allowed to (:mod:`eaglenest.pipeline.entry`, :mod:`eaglenest.tinytarget.entry`);
``python -m eaglenest.<stage>.cli`` runs the CLI module directly, as before.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def enter(prog: str, module: str, argv: list[str] | None = None) -> int:
    """Import ``module`` and return its ``main(argv)``; a Ctrl-C that the command did not handle itself
    (while the module imports, or before ``main`` set its own handling up) ends the process with one line.
    A caller of its own (``argv`` given: the entry point loaded and called in a process, as the tests do) or a
    person's Python session (a REPL, IPython, Jupyter: its interrupt is SIGINT too) gets the exception."""
    try:
        return importlib.import_module(module).main(argv)
    except KeyboardInterrupt:
        if argv is not None or _interactive():
            raise
        return interrupted(prog)


def _interactive() -> bool:
    """``eaglenest.launch.interactive``, which is not imported here: it takes a tenth of a second."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules \
        or "ipykernel" in sys.modules


def interrupted(prog: str) -> int:
    """Say ``<prog>: interrupted`` and end the process by SIGINT, as the command does after its cleanup (a
    shell running it in a loop stops too); a second Ctrl-C meanwhile ends it at once, silently."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        sys.stdout.flush()
    except (OSError, ValueError):  # the terminal is gone
        pass
    os.kill(os.getpid(), signal.SIGINT)
    return 130  # reached only where SIGINT cannot end the process (not the main thread)
