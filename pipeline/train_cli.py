"""``train run`` / ``train launch``: train an EAGLE-3 draft from the run's feature store.

``train run`` works as a plain process and under ``torchrun --nproc-per-node N -m
eaglenest.pipeline.train_cli run ...`` (FSDP2, see docs/training.md). ``train launch --nproc N ...`` is
the same as that torchrun line: it starts torchrun with this interpreter and waits for it.
``train launch --nnodes M --rdzv-endpoint HOST:PORT`` (run once per node) is torchrun's multi-node
line with its c10d rendezvous (docs/training.md, "Multi-node"): this module only translates and
checks options; rendezvous, worker restarts and failure detection are torchrun's own.

The command lives above the stages because ``train.select.every_steps`` scores snapshots by serving
them (export and evaluate come after train); the trainer itself imports neither. ``train run`` is
:func:`eaglenest.pipeline.commands.cmd_run`, imported when it runs (torch, the trainer); ``--help``
and ``launch`` import neither.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile

from eaglenest.cli import Command, run
from eaglenest.errors import ConfigError
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.stream.group import is_local
from eaglenest.launch import import_torch_quietly

log = logging.getLogger(__name__)


def rdzv_id(workdir: str) -> str:
    """The default ``--rdzv-id``: the same on every node that runs the same recipe (its ``run.workdir``)."""
    return "eaglenest-" + hashlib.sha256(os.path.normpath(workdir).encode()).hexdigest()[:12]


#: ``--rdzv-timeout``'s default: torchrun's own join_timeout.
RDZV_TIMEOUT_S = 600.0


def torchrun_argv(*, nnodes: int, nproc_per_node: int, node_rank: int | None, rdzv_endpoint: str | None,
                  rdzv_id: str, max_restarts: int, rdzv_timeout_s: float = RDZV_TIMEOUT_S) -> list[str]:
    """torchrun's options for one node's agent; ConfigError (exit 2) for options that do not fit."""
    if nnodes < 1 or nproc_per_node < 1:
        raise ConfigError(f"--nnodes ({nnodes}) and --nproc-per-node ({nproc_per_node}) must be at least 1")
    if not (math.isfinite(rdzv_timeout_s) and rdzv_timeout_s > 0):
        raise ConfigError(f"--rdzv-timeout: a number of seconds > 0, got {rdzv_timeout_s}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ConfigError(f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node, "
                              "a port node 0 can listen on)")
        return ["--standalone", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    host, _, port = rdzv_endpoint.rpartition(":")
    name = host[1:-1] if host[:1] == "[" and host[-1:] == "]" else host  # [::1]:29400
    # ASCII digits only: str.isdigit() also takes '²' (int() refuses it) and fullwidth digits (torchrun does)
    digits = port.isascii() and port.isdigit()
    if not name or not digits or not 0 < int(port) < 65536 or "[" in name or "]" in name \
            or (":" in name and name == host):
        raise ConfigError(f"--rdzv-endpoint must be HOST:PORT (an IPv6 host in brackets: [::1]:29400), "
                          f"got {rdzv_endpoint!r}")
    out = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}", f"--max-restarts={max_restarts}"]
    # The longest wait for the other nodes to join (join_timeout), and for each try to reach node 0's
    # store (read_timeout, torch's 60 s at most; torch tries twice).
    wait = math.ceil(rdzv_timeout_s)
    conf = [f"join_timeout={wait}", f"read_timeout={min(wait, 60)}"]
    if node_rank is not None:
        # Node 0 hosts the rendezvous store at the endpoint, the others connect to it; without a node
        # rank torchrun guesses from the host name (on one host: whichever agent binds the port first).
        # Not passed as torchrun's --node-rank: c10d ignores it (global ranks follow the rendezvous).
        conf.insert(0, f"is_host={int(node_rank == 0)}")
    return [*out, f"--rdzv-conf={','.join(conf)}"]


def check_cpus(nproc_per_node: int) -> None:
    """More ranks on this node than CPUs it may use: each rank needs a core of its own."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc_per_node > cpus:
        raise ConfigError(f"--nproc-per-node {nproc_per_node}: more ranks than the {cpus} CPU(s) this node may "
                          f"use; at most --nproc-per-node {cpus}")


def check_resolves(rdzv_endpoint: str | None) -> None:
    """A rendezvous host that does not resolve: torch retries it for minutes, silently."""
    if rdzv_endpoint is None:
        return
    host = rdzv_endpoint.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:  # UnicodeError: not a host name at all (an empty or 64+ char label)
        why = getattr(exc, "strerror", None) or exc
        raise ConfigError(f"--rdzv-endpoint {rdzv_endpoint}: cannot resolve host {host!r} ({why}): "
                          "use node 0's host name or address, the same on every node") from None


def check_recipe_file(recipe_path: str | None) -> None:
    """Every rank reads ``--recipe`` again: a pipe (``--recipe <(cmd)``, which ``train run`` takes) has been
    read by this process, and each rank then said '/dev/fd/63: file not found'."""
    if recipe_path is None:
        return
    try:
        regular = stat.S_ISREG(os.stat(recipe_path).st_mode)
    except (OSError, ValueError):  # the recipe loaded, so it was there: a pipe's fd that is gone now
        regular = False
    if not regular:
        raise ConfigError(f"--recipe {recipe_path}: not a regular file (a pipe or process substitution?): the "
                          "ranks `train launch` starts each read the recipe again; give a recipe file")


def _launch(recipe, args) -> int:
    check_recipe_file(args.recipe)
    opts = torchrun_argv(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, node_rank=args.node_rank,
                         rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts,
                         rdzv_id=args.rdzv_id or rdzv_id(recipe.run.workdir), rdzv_timeout_s=args.rdzv_timeout)
    check_resolves(args.rdzv_endpoint)
    check_world(recipe.train, args.nnodes * args.nproc_per_node)
    check_stream_addr(recipe.train, hosts_rank_0=args.nnodes == 1 or args.node_rank == 0)
    check_cpus(args.nproc_per_node)
    rest = ["-m", "eaglenest.pipeline.train_cli", "run"]
    if args.recipe:
        rest += ["--recipe", args.recipe]
    rest += list(args.overrides) + ["-v"] * args.verbose
    log.info("%s", shlex.join(["torchrun", *opts, *rest]))
    # torchrun's own folder (its ranks' error files) is a mkdtemp it never removes: one /tmp/torchelastic_* per
    # launch. Given here (the same attempt/rank layout inside), removed once torchrun has reported.
    logs = tempfile.mkdtemp(prefix="eaglenest-torchrun-")
    try:
        return wait_torchrun([sys.executable, "-c", _TORCHRUN, f"--log-dir={logs}", *opts, *rest])
    finally:
        shutil.rmtree(logs, ignore_errors=True)


#: Seconds torchrun gets to stop its ranks after a Ctrl-C or SIGTERM of `train launch` (then it is killed).
TORCHRUN_STOP_S = 30.0


def wait_torchrun(cmd: list[str]) -> int:
    """Run torchrun and wait for it. Interrupted (Ctrl-C, SIGTERM: a KeyboardInterrupt here), torchrun is
    sent SIGTERM and given :data:`TORCHRUN_STOP_S` to stop its ranks, which then end through their own
    cleanup: ``subprocess.call`` killed it at once, so its ranks were left to the process guard."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=TORCHRUN_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


def check_world(train, world: int) -> None:
    """Refuse, before torchrun starts a rank, a ``train`` section this many ranks cannot run (each rank
    would refuse it on its own, after loading the target and the data)."""
    cp = train.context_parallel
    if world % cp:
        raise ConfigError(f"train.context_parallel={cp}: needs a multiple of {cp} ranks, --nnodes x --nproc gives "
                          f"{world}")
    if world > 1 and train.family == "dflash" and train.dflash.num_layers > 1:
        raise ConfigError(f"train.dflash.num_layers={train.dflash.num_layers}: a DFlash draft of more than one "
                          f"layer trains in one process for now (its layers share k_norm, which FSDP2 cannot "
                          f"shard per layer): --nproc 1, or train.dflash.num_layers=1")
    if world > 1 and train.source == "stream" and train.stream.transport == "unix":
        raise ConfigError(f"train.stream.transport=unix: its one capture engine feeds one rank, --nnodes x --nproc "
                          f"gives {world}: run `train run`, or set train.stream.transport=gloo (docs/featurestore.md)")


def check_stream_addr(train, *, hosts_rank_0: bool) -> None:
    """train.stream.addr of a gloo stream, on the node whose rank 0 hosts its store: a host name that does not
    resolve is refused here, before torchrun starts a rank (rank 0 refuses it too, and an address of another
    host within seconds: featurestore.stream.group.Group)."""
    if hosts_rank_0 and train.source == "stream" and train.stream.transport == "gloo":
        host, _ = parse_addr(train.stream.addr)
        is_local(host, train.stream.addr, "train.stream.addr")  # a name that does not resolve: one line


#: The torchrun process: torchrun itself (``python -m torch.distributed.run``) but for its exit (:func:`torchrun`).
_TORCHRUN = "import sys; from eaglenest.pipeline.train_cli import torchrun; sys.exit(torchrun(sys.argv[1:]))"


def torchrun(argv: list[str]) -> int:
    """torchrun with ``argv``: when the first rank to fail exited with 2 (bad input: it printed its one
    line) and the others exited 2 as well or were stopped by torchrun, exit 2 without torchrun's
    ChildFailedError traceback; a rendezvous store that cannot be hosted or reached (a port in use, a
    wrong host) is one line and exit 2 too; stopped by a signal (Ctrl-C, SIGTERM), it ends by that signal
    once its ranks are stopped; any other failure is torchrun's own (traceback, its exit code 1)."""
    import_torch_quietly()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except RendezvousConnectionError as exc:
        print(f"train: error: {rendezvous_error(argv, exc)}", file=sys.stderr)
        return 2
    except RendezvousTimeoutError:
        print(f"train: error: {rendezvous_timeout(argv)}", file=sys.stderr)
        return 2
    except SignalException as exc:
        # Ctrl-C, or `train launch` stopping it (wait_torchrun): the agent has stopped its ranks, which said
        # so; end by the signal, without the exception's traceback under the launcher's one line.
        signal.signal(exc.sigval, signal.SIG_DFL)
        os.kill(os.getpid(), exc.sigval)
        return 128 + int(exc.sigval)  # not reached
    except ChildFailedError as exc:
        _, first = exc.get_first_failure()
        # The first rank out exited 2; the others exited 2 too or were stopped by torchrun (SIGTERM: < 0).
        if first.exitcode == 2 and all(f.exitcode == 2 or f.exitcode < 0 for f in exc.failures.values()):
            return 2
        raise
    return 0


def rendezvous_error(argv: list[str], exc: BaseException) -> str:
    """One line for a rendezvous store torchrun could not host or reach, naming the endpoint and the cause."""
    endpoint = next((a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint=")), None)
    cause = exc
    while cause.__cause__ is not None:  # torch's own error (EADDRINUSE, connection refused) is the innermost
        cause = cause.__cause__
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
    if endpoint is None:  # --standalone: torchrun chose the port itself
        return f"torchrun could not host its local rendezvous store ({first})"
    return (f"--rdzv-endpoint {endpoint}: cannot host or reach the rendezvous store ({first}); "
            "use a free port of node 0's host, the same on every node")


def rendezvous_timeout(argv: list[str]) -> str:
    """One line for a rendezvous that timed out: a node never joined (or joined another id)."""
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    conf = dict(x.split("=", 1) for x in opts.get("rdzv-conf", "").split(",") if "=" in x)
    return (f"--rdzv-endpoint {opts.get('rdzv-endpoint')}: not all {opts.get('nnodes')} nodes joined rendezvous "
            f"'{opts.get('rdzv-id')}' within --rdzv-timeout {conf.get('join_timeout', '?')} s; start `train launch` "
            "on every node with the same --nnodes, --rdzv-endpoint and --rdzv-id (default: the same run.workdir)")


LAUNCH_ARGS = [
    (("--nproc-per-node", "--nproc"), {"type": int, "default": 2, "dest": "nproc_per_node",
                                       "help": "ranks (processes) on this node"}),
    (("--nnodes",), {"type": int, "default": 1, "help": "nodes; > 1 needs --rdzv-endpoint"}),
    (("--node-rank",), {"type": int, "default": None, "help": "this node's index (optional with c10d; "
                                                              "0 hosts the rendezvous store)"}),
    (("--rdzv-endpoint",), {"default": None, "metavar": "HOST:PORT",
                            "help": "c10d rendezvous address, the same on every node (node 0's host)"}),
    (("--rdzv-id",), {"default": None, "help": "rendezvous id (default: derived from run.workdir)"}),
    (("--max-restarts",), {"type": int, "default": 0, "help": "torchrun worker-group restarts on failure"}),
    (("--rdzv-timeout",), {"type": float, "default": RDZV_TIMEOUT_S, "metavar": "SECONDS",
                           "help": "longest wait for every node to join the rendezvous (default 600)"}),
]

COMMANDS = {
    "run": Command("eaglenest.pipeline.commands:cmd_run", "train a draft head on the features table (TTT objective)"),
    "launch": Command(_launch, "run `train run` under torchrun (FSDP2), on one node or several",
                      args=LAUNCH_ARGS),
}


def main(argv: list[str] | None = None) -> int:
    return run("train", "Train EAGLE-3 draft heads from the feature store.", COMMANDS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
