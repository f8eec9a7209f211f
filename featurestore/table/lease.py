"""Writer leases: at most one process writes a table at a time, and a busy table names its writer.

Why a lease and not only Lance's optimistic commits: Lance rebases two ``Append`` commits onto each
other without complaint, so two captures that each decided at start which samples were missing
would both append them (every sample twice). And ``gc`` must never delete data files that a live
writer has written but not yet committed. Both need to know whether a writer is live, which Lance
does not track. So every process that changes a table holds its lease for as long as its view of
the table must stay true:

* ``featurestore capture`` and ``ingest build`` for the whole run (they decide what is missing at
  the start, then append it);
* ``commit_fragments`` (``store.append``) for one commit, re-checking ``sample_id`` uniqueness under it;
* ``compact``, ``gc``, ``restore`` and tag changes for the operation.

Mechanism: a POSIX record lock (``fcntl.lockf``) on ``<store>/.eaglenest/leases/<table>.lease``,
whose content says who holds it (pid, host, start time, what for). The kernel drops the lock when
the holder dies, however it dies (SIGKILL included), so a stale lease needs no clean-up: the next
writer takes it and logs whose it was. Record locks, unlike ``flock``, belong to the process and
are not inherited across ``fork``, so an engine process a killed CLI leaves behind does not keep
the table locked. They also work on NFS (through its lock manager). Not on object storage: a store
there has no lease (a lock object of our own could outlive a killed holder); instead each commit's
``sample_id`` check and the commit itself are made one step by Lance's commit protocol (a commit
Lance refuses, by the conditional PUT of the next manifest, when another landed after the checked
version; ``fragments._serial_append``), so racing writers are serialized or refused there too
(docs/storage.md says what that guarantees).

The thread holding a lease re-enters it at once (capture holds it and commits under it); another
thread of the same process waits for it as another process would (record locks belong to the
process: without that, threads appending at once would each commit unchecked, every row stored twice).
Caveat of record locks: closing *any* descriptor of the lease file in the holding process drops
the lock, so this module never opens a lease file it holds a second time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import logging
import os
import random
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

from eaglenest.errors import StoreError
from eaglenest.featurestore.table.names import check_name
from eaglenest.featurestore.table.objects import is_remote, local
from eaglenest.paths import pid_alive

log = logging.getLogger(__name__)

#: How long a single commit (``store.append``, a library writer) waits for a busy lease.
WAIT_S = 30.0
#: How long ``compact``, ``gc``, ``restore`` and tag changes wait before saying who holds it.
MAINTENANCE_WAIT_S = 5.0
#: How long a new pin waits for a ``gc`` that is removing versions (then a one-line error naming it, s).
PIN_WAIT_S = 60.0
#: A pin's temporary (``<pid>-<id>.tmp``) unlocked and older than this is a killed reader's (seconds).
PIN_TMP_AGE_S = 60.0

_held: dict[str, list] = {}  # lease path -> [fd, depth, thread] for leases this process holds
_pins: dict[str, int] = {}   # pin file -> version, for pins this process holds
_unpinned_tables: set[str] = set()  # "<store>:<table>" whose pins failed (warned once)
_create_locks: dict[str, threading.Lock] = {}  # create lock file -> the threads' turn at it
_mutex = threading.RLock()


def _remote(uri: str) -> bool:
    return is_remote(uri)


def lease_path(uri: str, name: str, kind: str = "lease") -> Path:
    """The lock file of table ``name``: ``kind`` "lease" (writers), "tags" (tag changes vs gc)."""
    # Resolved: one file, one key, however the store is spelled ("runs/s", "./runs/s", "file:///...",
    # a symlink). Opening and closing the same file under a second spelling would drop this process's lock.
    return store_dir(uri) / ".eaglenest" / "leases" / f"{check_name(name)}.{kind}"


def store_dir(uri: str) -> Path:
    """A local store's directory, resolved (``file:///x`` is ``/x``, not ``./file:/x``)."""
    return Path(local(uri)).resolve()


def _read_info(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode()) if raw.strip() else None
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None  # a holder record someone overwrote: no holder recorded


def describe(info: dict | None) -> str:
    if not info:
        return "another process (no holder recorded)"
    text = (f"pid {info.get('pid')} on host {info.get('host')} since {info.get('since')} "
            f"({info.get('purpose', '?')})")
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) and not pid_alive(info["pid"]):
        text += "; that pid has exited, so a process it started still holds the lock"
    return text


def holder(uri: str, name: str) -> dict | None:
    """Who holds the lease now (None: free). Never call it for a lease this process holds."""
    path = lease_path(uri, name)
    if str(path) in _held:
        return json.loads(_info_text("(this process)"))
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return _read_info(fd) or {}
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _info_text(purpose: str) -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                       "purpose": purpose, "argv": " ".join(sys.argv)[:300]})


@contextlib.contextmanager
def hold(uri: str, name: str, *, purpose: str, wait_s: float = 0.0, kind: str = "lease") -> Iterator[None]:
    """Hold table ``name``'s writer lease for the block. Busy for longer than ``wait_s``: a
    :class:`StoreError` naming the holder (pid, host, since when, what it is doing).

    ``kind="tags"`` is a second, separate lock that tag changes and ``gc`` take: a tag may be set
    while a capture writes (tags touch no data), but never while ``gc`` decides what to remove."""
    if _remote(uri):  # object storage: no lease (module docstring)
        yield
        return
    path = lease_path(uri, name, kind)
    key = str(path)
    deadline = time.monotonic() + max(0.0, wait_s)
    if _claim(key, deadline, f"table '{name}' in {uri} is being written by another thread of this process "
                             f"(pid {os.getpid()}): this {purpose} waited {wait_s:.0f} s"):
        try:  # re-entered by the thread that holds it
            yield
        finally:
            with _mutex:
                _held[key][1] -= 1
        return
    try:
        fd = _lock(path, deadline, name=name, uri=uri, purpose=purpose, wait_s=wait_s)
    except BaseException:
        with _mutex:
            del _held[key]  # the claim: other threads may try now
        raise
    try:
        previous = _read_info(fd)
        if previous and previous.get("pid") != os.getpid():
            log.info("took over the lease of table '%s' last held by %s (it ended without releasing it)",
                     name, describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, _info_text(purpose).encode(), 0)
        with _mutex:
            _held[key][0] = fd
        yield
    finally:
        with _mutex:
            del _held[key]
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)


def _claim(key: str, deadline: float, busy: str) -> bool:
    """Claim lease ``key`` for this thread before its lock is taken: True if this thread holds it
    already (re-entered), False once claimed. Another thread's hold is waited for until ``deadline``
    (then a :class:`StoreError` saying ``busy``): record locks belong to the process, so the kernel
    would let a second thread of it "take" the lock at once, and two commits would race unchecked."""
    me = threading.get_ident()
    while True:
        with _mutex:
            entry = _held.get(key)
            if entry is None:
                _held[key] = [None, 1, me]  # [fd, depth, holding thread]; the fd once the lock is taken
                return False
            if entry[2] == me:
                entry[1] += 1
                return True
        if time.monotonic() >= deadline:
            raise StoreError(f"{busy}; run it when that one has finished (nothing was changed)")
        time.sleep(0.01 + 0.02 * random.random())


def _lock(path: Path, deadline: float, *, name: str, uri: str, purpose: str, wait_s: float) -> int:
    """The lease file ``path`` opened and record-locked (waiting for another process until ``deadline``)."""
    fd = _open_lock_file(path, "the writer lease ")
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise StoreError(f"run.store: cannot lock {path} ({exc.strerror})") from None
            if time.monotonic() >= deadline:
                info = _read_info(fd)
                os.close(fd)
                raise StoreError(f"table '{name}' in {uri} is being written by {describe(info)}: "
                                 f"this {purpose} waited {wait_s:.0f} s; run it when that one has "
                                 "finished (nothing was changed)")
            time.sleep(0.05 + 0.1 * random.random())
    return fd


def _open_lock_file(path: Path, what: str = "") -> int:
    """A descriptor of the lock file ``path`` (made with its folder if need be); failing, one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StoreError(f"run.store: cannot create {what}{path} ({exc.strerror or exc}); "
                         "is the store writable?") from None


def held_here(uri: str, name: str) -> bool:
    """Whether this process holds table ``name``'s lease."""
    return str(lease_path(uri, name)) in _held


@contextlib.contextmanager
def create_lock(uri: str, name: str) -> Iterator[None]:
    """A short lock around creating table ``name`` (blocking; creation takes milliseconds). Separate
    from the writer lease: Dask workers write fragments while their driver holds the lease."""
    if _remote(uri):
        yield
        return
    path = lease_path(uri, name).with_suffix(".create")
    with _mutex:  # the record lock is the process's: threads of it take turns here first
        in_process = _create_locks.setdefault(str(path), threading.Lock())
    with in_process:
        fd = _open_lock_file(path)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor drops the record lock


# -- reader pins: a version a live reader (a training run) is reading is never removed by gc -----

def _pins_dir(uri: str, name: str) -> Path:
    return store_dir(uri) / ".eaglenest" / "pins" / check_name(name)


@contextlib.contextmanager
def pin(uri: str, name: str, version: int, *, purpose: str = "train") -> Iterator[None]:
    """Mark ``version`` of ``name`` as being read for the block: ``gc`` keeps it (and everything
    newer). The pin is a file this process holds a record lock on, so a reader that dies unpins at
    once. A store that cannot be written (a read-only copy) is read without a pin (:func:`_unpinned`
    says so once); an object store has no pins (``gc`` there warns that it does not honour them)."""
    if _remote(uri):
        yield
        return
    path = _pins_dir(uri, name) / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
    # Locked and written under a name gc does not list, then renamed into place (the lock stays with
    # the file): a gc between the open and the lock would take the pin for a dead reader's and
    # delete it, and one between the lock and the write would find no version in it.
    # Known as this process's own before the file appears under its name: a gc in another thread of this
    # process would otherwise lock it (record locks are the process's), take it for a dead reader's,
    # delete it, and drop the lock by closing its descriptor.
    with _mutex:
        _pins[str(path)] = int(version)
    try:
        fd = _make_pin(path, version, purpose)
    except OSError as exc:
        with _mutex:
            _pins.pop(str(path), None)
        _unpinned(uri, name, version, exc)
        yield
        return
    try:
        # A gc that listed the pins before this one appeared and is removing versions now: waited out, so
        # the caller's next open of the version finds it kept or names it collected (not half-deleted later).
        _wait_for_gc(uri, name, version, purpose)
        yield
    finally:
        with _mutex:
            _pins.pop(str(path), None)
        for leftover in (path, path.with_suffix(".tmp")):
            with contextlib.suppress(OSError):
                leftover.unlink()
        os.close(fd)


def _make_pin(path: Path, version: int, purpose: str) -> int:
    """The pin file ``path``, made through ``<path>.tmp`` (pin), locked; its descriptor. Failing (no
    permission, no locks on this file system, a full disk), the OSError, with nothing left behind."""
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = json.loads(_info_text(purpose))
        os.pwrite(fd, json.dumps({**info, "version": int(version)}).encode(), 0)
        os.rename(tmp, path)
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return fd


def _wait_for_gc(uri: str, name: str, version: int, purpose: str) -> None:
    """Return once no ``gc`` of table ``name`` is between its last listing of the pins and the end of Lance's
    removal (it holds the table's "pins" lock, ``kind="pins"`` of :func:`hold`, for that window); waiting
    longer than :data:`PIN_WAIT_S`, a :class:`StoreError` naming it. The lock is only tested, never written
    (a read leaves the store as it was), and not looked for where no gc ever made it."""
    path = lease_path(uri, name, "pins")
    key = str(path)
    deadline = time.monotonic() + PIN_WAIT_S
    busy = (f"table '{name}' in {uri}: a `featurestore gc` is removing versions; the pin of version {version} "
            f"({purpose}) waited {PIN_WAIT_S:.0f} s for it")
    if _claim(key, deadline, f"{busy} (another thread of this process, pid {os.getpid()})"):
        with _mutex:  # this thread is the gc: its own pins are counted as it lists them
            _held[key][1] -= 1
        return
    try:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:  # no gc made it yet (a later one lists this pin), or it cannot be opened: no gc here
            return
        try:
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        return
                    if time.monotonic() >= deadline:
                        raise StoreError(f"{busy} (held by {describe(_read_info(fd))}); run it again when that "
                                         "gc has finished") from None
                    time.sleep(0.05 + 0.1 * random.random())
            fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        with _mutex:
            del _held[key]


def _unpinned(uri: str, name: str, version: int, exc: OSError) -> None:
    """Say once per table and process that its reads are not pinned. A read-only file system needs
    no pin (no ``gc`` can run on it): said at debug level only. Another reason (no permission, a
    full disk) warns, once: a process may read a table many times, and each read pins."""
    key = f"{store_dir(uri)}:{name}"
    with _mutex:
        first = key not in _unpinned_tables
        _unpinned_tables.add(key)
    if exc.errno == errno.EROFS or not first:
        log.debug("version %s of table '%s' read without a pin (%s)", version, name, exc.strerror or exc)
        return
    log.warning("cannot pin versions of table '%s' in %s (%s): they are read without a pin, so a "
                "`featurestore gc` meanwhile could remove them (said once)", name, uri, exc.strerror or exc)


def pinned_versions(uri: str, name: str) -> set[int]:
    """Versions of ``name`` that live readers hold pinned; stale pin files are removed."""
    out: set[int] = set()
    if _remote(uri):  # no pins on object storage (pin); not a folder named "s3:" under the working directory
        return out
    folder = _pins_dir(uri, name)
    if not folder.is_dir():
        return out
    _sweep_pin_temporaries(folder)
    for path in folder.glob("*.json"):
        with _mutex:
            mine = _pins.get(str(path))
        if mine is not None:  # this process's own pin: never reopened (closing it would unlock it)
            out.add(mine)
            continue
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a live reader
                info = _read_info(fd)
                if info and "version" in info:
                    out.add(int(info["version"]))
                continue
            path.unlink()  # its reader is gone
        finally:
            os.close(fd)
    return out


def _sweep_pin_temporaries(folder: Path) -> None:
    """Remove the pin temporaries (``*.tmp``) of readers killed before the rename: unlocked and older than
    :data:`PIN_TMP_AGE_S` (a live reader locks its own within microseconds of making it, until it is renamed).
    This process's own are never opened (closing one would unlock it)."""
    for tmp in folder.glob("*.tmp"):
        with _mutex:
            if str(tmp.with_suffix(".json")) in _pins:
                continue
        try:
            if time.time() - tmp.lstat().st_mtime < PIN_TMP_AGE_S:
                continue
            fd = os.open(tmp, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live reader's
            continue
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
        finally:
            os.close(fd)
