"""Running a parsed command: what every eaglenest command does between its arguments and its body.

:func:`execute` sets up logging (here, once, and nowhere else), lets ``kill -USR1`` dump every
thread's stack, starts the process guard (:mod:`eaglenest.reaper`: whatever the command starts,
engines, servers, workers, ends with it), loads and validates the recipe, registers the store's
options for this process, remembers where vLLM should log (written only when an engine starts:
:func:`eaglenest.engine.defer_quiet_vllm`), and calls the command's body, imported only now. User
errors (:class:`EaglenestError`) become exit code 2 and one line on stderr (under torchrun, once per
node: :func:`first_to_say`). A SIGTERM (``kill``, a scheduler's stop, torchrun stopping its other
ranks) or a SIGHUP (a closed terminal or ssh session) unwinds like Ctrl-C, so the same cleanup runs
(an import's uncommitted new table is removed, engines are closed), then the process ends by that
signal (its parent sees it signalled, as before); so does Ctrl-C (SIGINT), so a shell script or loop
running the command stops with it. Output piped into a reader that stops early (``| head``) ends the
command quietly, exit 141.
``eaglenest.cli`` parses the arguments and imports this module only once they are accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import functools
import hashlib
import importlib
import json
import logging
import os
import secrets
import select
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from eaglenest import reaper
from eaglenest.config import printable
from eaglenest.engine import defer_quiet_vllm
from eaglenest.errors import EaglenestError
from eaglenest.paths import pid_alive, pid_prefix
from eaglenest.provenance import running_command
from eaglenest.recipe import load_recipe


#: The root handler :func:`setup_logging` installed (None: none yet, or the host program has its own).
_our_handler: logging.Handler | None = None


def setup_logging(verbose: int) -> None:
    """This command's ``-v`` level. A host program's own logging setup is left as it is; the handler an
    earlier command in this process installed (a notebook, a script calling several ``main``) takes this
    command's level, not the first command's."""
    global _our_handler
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose == 1 else logging.WARNING
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _our_handler = root.handlers[0] if root.handlers else None
    elif _our_handler in root.handlers:
        root.setLevel(level)
    logging.getLogger("eaglenest").setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


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


#: Signals that end a CLI the way Ctrl-C does, its cleanup first: SIGTERM (``kill``, a scheduler's
#: stop, torchrun stopping its other ranks) and SIGHUP (the terminal or ssh session was closed).
UNWOUND = ("SIGTERM", "SIGHUP")


class Terminated(KeyboardInterrupt):
    """A signal of :data:`UNWOUND`, raised in the main thread where it lands: every
    ``except BaseException`` / ``KeyboardInterrupt`` cleanup path runs for it as for Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = signum


def _unwound() -> list[int]:
    return [getattr(signal, name) for name in UNWOUND if hasattr(signal, name)]


def _raise_terminated(signum, frame) -> None:
    for sig in _unwound():  # a second signal during the cleanup ends the process at once
        if signal.getsignal(sig) is _raise_terminated:
            signal.signal(sig, signal.SIG_DFL)
    raise Terminated(signum)


def unwind_on_sigterm() -> list[int]:
    """Make each signal of :data:`UNWOUND` raise :class:`Terminated`; returns those it set. A signal
    the host program handles or ignores (``nohup``) is left alone, and so is every one off the main thread."""
    ours = []
    for sig in _unwound():
        if signal.getsignal(sig) is not signal.SIG_DFL:
            continue
        try:
            signal.signal(sig, _raise_terminated)
        except ValueError:  # not the main thread of the main interpreter
            break
        ours.append(sig)
    return ours


#: Whether a real Ctrl-C (SIGINT) raised the KeyboardInterrupt the command is unwinding from.
_sigint_seen = False


def _raise_keyboard_interrupt(signum, frame) -> None:
    """Python's own SIGINT handler, remembering the signal: the CLI then ends by SIGINT after its cleanup."""
    global _sigint_seen
    _sigint_seen = True
    raise KeyboardInterrupt


def end_by_sigint_after_cleanup() -> bool:
    """Make Ctrl-C raise KeyboardInterrupt as before, remembered (:func:`execute` then ends the process by
    SIGINT: a shell running the command in a script or a loop stops too, where an exit code, 130
    included, tells it the command handled Ctrl-C itself and it goes on). Only where Python's own
    handler is installed, in the main thread; returns whether it was set."""
    global _sigint_seen
    _sigint_seen = False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler or interactive():
        return False
    try:
        signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    except ValueError:  # not the main thread of the main interpreter
        return False
    return True


def interactive() -> bool:
    """Whether a person's Python session runs the command (a REPL, IPython, a Jupyter kernel, whose
    interrupt is SIGINT too): Ctrl-C there must stop the command, not end the session."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules \
        or "ipykernel" in sys.modules


def end_by_signal(prog: str, signum: int) -> int:
    """After the cleanup: end the process by ``signum``'s default action, as if no handler had been set.
    The line saying so is said once per torchrun node and attempt (:func:`first_to_say`): a stop reaches
    every rank, and each printed it; and not again by a launcher whose ranks said it (``train launch``
    waits for them, and printed the same line under theirs: :data:`STOP_SAID_ENV`)."""
    named = "" if signum == signal.SIGTERM else f" ({signal.Signals(signum).name})"
    said = f"{prog}: interrupted" if signum == signal.SIGINT else f"{prog}: terminated{named}"
    below = _stop_said_below()
    _drop_stop_marker(_stop_marker)  # the process ends here: execute's own cleanup does not run
    told = f"{said}\n" if not below and first_to_say(said) else ""
    if told:
        _mark_stop_said()
    for line, stream in ((told, sys.stderr), ("", sys.stdout), ("", sys.stderr)):
        try:  # after a hangup the terminal is gone: writing to it fails
            stream.write(line)
            stream.flush()
        except (OSError, ValueError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum  # not reached (the signal is delivered before os.kill returns)


#: The file whose existence says a process this command started (``train launch``'s torchrun ranks) has
#: said the stop: the path is in the environment the command's processes inherit (:func:`_own_stop_marker`).
STOP_SAID_ENV = "EAGLENEST_STOP_SAID"
#: This command's own marker path (None: none, or an outer command's, inherited, is in the environment).
_stop_marker: str | None = None


#: The markers' name: :data:`STOP_MARKER_PREFIX` ``<pid of the command that named it>-<random>``.
STOP_MARKER_PREFIX = "eaglenest-stop-said-"
#: A marker lives from a rank's stop line to its launcher's end (torchrun stops within TORCHRUN_STOP_S):
#: one older than this is a leftover even where its pid is in use again.
STALE_MARKER_S = 600.0


def _own_stop_marker() -> str | None:
    """The outermost command names a marker path for the processes it starts; None for those below it. A
    marker inherited from a command that is gone (an environment copied from a rank's) is no outer command:
    taken for one, this command's ranks marked a file no one removes and the stop was said twice."""
    global _stop_marker
    inherited = os.environ.get(STOP_SAID_ENV)
    if inherited and _marker_owner_alive(os.path.basename(inherited)):
        return None
    _remove_leftover_markers()
    _stop_marker = os.path.join(tempfile.gettempdir(),
                                f"{pid_prefix(STOP_MARKER_PREFIX)}{secrets.token_hex(4)}")
    os.environ[STOP_SAID_ENV] = _stop_marker
    return _stop_marker


def _marker_owner_alive(name: str) -> bool:
    """Whether the command whose pid names marker ``name`` still runs (a name of another form: assumed so)."""
    pid = name.removeprefix(STOP_MARKER_PREFIX).split("-", 1)[0]
    return not (name.startswith(STOP_MARKER_PREFIX) and pid.isdigit()) or pid_alive(int(pid))


def _remove_leftover_markers() -> None:
    """The markers in the temp folder that their command could not remove (SIGKILLed after its ranks said the
    stop: one file more per killed launch): its pid is gone, or the file is older than any stop lasts."""
    folder = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(folder) if n.startswith(STOP_MARKER_PREFIX)]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(folder, name)
        try:
            if not _marker_owner_alive(name) or now - os.lstat(path).st_mtime > STALE_MARKER_S:
                os.unlink(path)
        except OSError:  # gone already, or another user's (a shared /tmp)
            pass


def _drop_stop_marker(marker: str | None) -> None:
    global _stop_marker
    if marker is None:
        return
    if os.environ.get(STOP_SAID_ENV) == marker:
        del os.environ[STOP_SAID_ENV]
    _stop_marker = None
    try:
        os.unlink(marker)
    except OSError:
        pass


def _stop_said_below() -> bool:
    """Whether a process this command started said its stop (a stop reaches the launcher and its ranks: the
    launcher, which waits for them, printed the same line under theirs)."""
    return _stop_marker is not None and os.path.exists(_stop_marker)


def _mark_stop_said() -> None:
    """Tell the command that started this one (its marker, inherited) that the stop has been said."""
    marker = os.environ.get(STOP_SAID_ENV)
    if marker and marker != _stop_marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_WRONLY, 0o600))
        except OSError:
            pass


def stdout_closed() -> bool:
    """Whether whoever reads this process's stdout has gone (``| head`` has its lines): the pipe's
    write end then polls as an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor behind stdout (captured in memory)
        return False


def end_quietly_on_closed_stdout() -> int:
    """The exit of a command whose reader went away: no traceback, nothing more written (stdout
    now goes nowhere, so the interpreter's last flush does not fail either), 128 + SIGPIPE as a
    shell reports ``yes | head -1``."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def first_to_say(line: str) -> bool:
    """Whether this process prints its refusal ``line``: yes, but for a torchrun rank whose node's
    other ranks already printed the same line (every rank refuses the same recipe or table: one line,
    not one per rank). A line only some ranks have (a file only this rank's rows read) is printed.

    The node's ranks share torchrun's folder of this attempt (``TORCHELASTIC_ERROR_FILE`` is
    ``<...>/attempt_<n>/<local rank>/error.json``); the first rank to create a marker named by the line's
    hash there prints it, the others exit quietly with the same code. A restart is a new attempt, so it
    says it again; without torchrun's folders every rank prints."""
    rank_dir = Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "/")).parent
    if rank_dir.name != os.environ.get("LOCAL_RANK") or not rank_dir.parent.name.startswith("attempt_"):
        return True  # not torchrun's folders (no torchrun, another launcher)
    marker = rank_dir.parent / f"eaglenest-refused-{hashlib.sha256(line.encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        pass
    return True


def resolve(fn: Callable[..., int] | str) -> Callable[..., int]:
    """A command body, imported now if named as ``"module:function"``."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def execute(prog: str, cmd, args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run ``cmd`` (an ``eaglenest.cli.Command``) on the parsed ``args``; the exit code. ``argv``: the
    arguments the command was run with (after ``prog``), which its provenance files record."""
    if argv is None:
        return _execute(prog, cmd, args)
    with running_command(prog, argv):
        return _execute(prog, cmd, args)


def _execute(prog: str, cmd, args: argparse.Namespace) -> int:
    setup_logging(args.verbose)
    dump_stacks_on_sigusr1()
    reaper.guard()  # engines and helpers end with this process, even under SIGKILL (common/reaper.py)
    ours = unwind_on_sigterm()
    sigint = end_by_sigint_after_cleanup()
    marker = _own_stop_marker()
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
        line = f"{prog}: error: {printable(str(exc))}"  # one line, whatever the input held
        if first_to_say(line):
            print(line, file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not stdout_closed():  # a connection of the command's own: a bug, with its traceback
            raise
        return end_quietly_on_closed_stdout()
    except Terminated as exc:
        return end_by_signal(prog, exc.signum)
    except KeyboardInterrupt:
        if _sigint_seen:
            return end_by_signal(prog, signal.SIGINT)
        print(f"{prog}: interrupted", file=sys.stderr)  # raised by code, not by Ctrl-C
        return 130
    finally:
        for sig in ours:
            if signal.getsignal(sig) is _raise_terminated:
                signal.signal(sig, signal.SIG_DFL)
        if sigint and signal.getsignal(signal.SIGINT) is _raise_keyboard_interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        _drop_stop_marker(marker)


def import_torch_quietly() -> None:
    """Import torch with torch's C++ log at FATAL: a TCPStore client that cannot reach its store (a
    rendezvous endpoint, a stream store at ``--addr`` that is another service) logged each retry with its
    C++ stack before the one line the command prints. c10 reads ``TORCH_CPP_LOG_LEVEL`` when torch is
    imported, so the variable is unset again at once: processes started later with this environment (the
    ranks, the capture engine's) log as usual. A level the user set is kept (``TORCH_CPP_LOG_LEVEL=WARNING``
    shows the C++ log). Used by torchrun's own process (``train launch``) and ``featurestore stream-serve``."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


#: c10's log level (0 INFO .. 3 FATAL), what ``TORCH_CPP_LOG_LEVEL`` sets when torch is imported.
_FATAL = 3
_quiet_lock = threading.Lock()
_quiet_depth = [0, 0]  # blocks inside quiet_cpp_log, the level before the first of them


@functools.cache
def _cpp_log_level():
    """c10's level flag in torch's loaded ``libc10`` (a ctypes int), or None where this torch has none."""
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def quiet_cpp_log():
    """torch's C++ log at FATAL while the block runs, in a process that imported torch at its usual level
    (a trainer rank): a TCPStore client whose address is another service logged each retry with its C++
    stack before the one line the command prints. Restored after the block; a level the user set with
    ``TORCH_CPP_LOG_LEVEL`` is kept (see :func:`import_torch_quietly`)."""
    flag = None if "TORCH_CPP_LOG_LEVEL" in os.environ else _cpp_log_level()
    if flag is None:
        yield
        return
    with _quiet_lock:
        if _quiet_depth[0] == 0:
            _quiet_depth[1] = flag.value
            flag.value = max(flag.value, _FATAL)
        _quiet_depth[0] += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth[0] -= 1
            if _quiet_depth[0] == 0:
                flag.value = _quiet_depth[1]


class QuietCalls:
    """``target`` whose method calls each run inside :func:`quiet_cpp_log`: a stream's TCPStore, whose client
    logged a C++ stack for every call once the store had gone (trainer rank 0 killed) before the rank's
    one line. ``target`` itself is what torch's own functions take (a ``PrefixStore`` over it)."""

    def __init__(self, target) -> None:
        self.target = target

    def __getattr__(self, name: str):
        attr = getattr(self.target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with quiet_cpp_log():
                return attr(*args, **kwargs)
        return call
