"""Output directories: made through one helper, and proven writable before a stage does any
expensive work.

A stage that starts an engine (tens of seconds to minutes) and only then finds it cannot write its
store or its ``stats.json`` wastes the run, so each command checks its output directories first
(:func:`ensure_writable`). The check *does* the write (a temporary file is created and removed)
rather than asking ``os.access``, which answers yes to root on a read-only mount. A check made
before the command has accepted all of its input passes ``keep=False``: the directories it created
are removed again, so a refused command leaves nothing behind. Every output folder is then made by
:func:`make_dir`, which turns what the OS refuses (read-only filesystem, permissions, disk full, a
file in the way) into the project's one line naming the key to change. Object-store URIs
(``s3://...``) are left to their own client: only local paths are checked. A path a user typed goes
through :func:`user_path` first, which turns what ``pathlib`` raises on awkward paths (a NUL byte, an
unknown user in ``~``, a symlink loop, a name too long) into that same one line.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from eaglenest.config import printable
from eaglenest.errors import EaglenestError, StoreError


def shown_path(path: str | Path) -> str:
    """``path`` for an error line: control characters escaped, at most 120 characters."""
    text = printable(str(path))  # a NUL or newline stays visible
    return text if len(text) <= 120 else "..." + text[-117:]  # the end of a path says the most


#: What the OS says of a path no one can use, in the words of an error line.
_AWKWARD = {errno.ELOOP: "symlink loop", errno.ENAMETOOLONG: "name too long"}


def user_path(path: str | Path, key: str, *, error: type[EaglenestError], base_dir: str | Path | None = None,
              resolve: bool = True) -> Path:
    """``path`` as given under ``key``: ``~`` expanded, made absolute against ``base_dir`` (when given
    and ``path`` is relative) and, with ``resolve``, its symlinks resolved. A path the OS cannot take
    (a NUL byte, an unknown user in ``~``, a symlink loop, a name too long) is ``error`` naming
    ``key`` and the path, one line; a path that does not exist is fine (the caller says what it needs)."""
    text = str(path)
    try:
        if "\0" in text:
            raise ValueError("embedded null byte")
        p = Path(text).expanduser()
        if base_dir is not None and not p.is_absolute():
            p = Path(base_dir) / p
        if resolve:
            p = p.resolve()
        try:
            os.stat(p)
        except OSError as exc:  # a missing path, or one the caller's own check reports (permissions)
            if exc.errno in _AWKWARD:
                raise
    except ValueError:
        why = "contains a NUL byte"
    except RuntimeError as exc:  # pathlib's words for a loop met while resolving, and for ~user
        why = "symlink loop" if "loop" in str(exc).lower() else "unknown user in ~"
    except OSError as exc:
        why = _AWKWARD[exc.errno]
    else:
        return p
    raise error(f"{key}: {shown_path(text)}: {why}") from None


def _refusal(exc: OSError, path: str | Path, key: str, error: type[EaglenestError]) -> EaglenestError:
    if isinstance(exc, FileExistsError):
        return error(f"{key}: {shown_path(path)} is a file, not a directory")
    return error(f"{key}: cannot write to {shown_path(path)} ({exc.strerror or type(exc).__name__})")


def _missing(p: Path) -> list[Path]:
    """The directories ``p.mkdir(parents=True)`` would create, deepest first."""
    out = []
    while not p.exists() and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def make_dir(path: str | Path, key: str, *, error: type[EaglenestError] = StoreError) -> Path:
    """Create directory ``path`` and its parents (an existing one is fine); an OS refusal is
    ``error`` naming ``key``, one line. Returns the path."""
    p = user_path(path, key, error=error, resolve=False)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _refusal(exc, path, key, error) from None
    return p


def ensure_writable(path: str | Path, key: str, *, error: type[EaglenestError] = StoreError,
                    keep: bool = True) -> None:
    """Create directory ``path`` if needed and prove it is writable; else ``error`` naming ``key``.
    ``keep=False``: remove the directories this check created (a check before the command's input
    is all accepted). Directories created by a check that fails are always removed."""
    text = str(path)
    if "://" in text:
        return
    p = user_path(text, key, error=error, resolve=False)
    created = _missing(p)
    try:
        make_dir(p, key, error=error)
        try:
            fd, tmp = tempfile.mkstemp(prefix=".eaglenest-write-check-", dir=p)
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            raise _refusal(exc, text, key, error) from None
    except EaglenestError:
        _remove(created)
        raise
    if not keep:
        _remove(created)


def _remove(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first; a directory someone else filled meanwhile stays
        try:
            d.rmdir()
        except OSError:
            break


def pid_prefix(prefix: str, pid: int | None = None) -> str:
    """``prefix`` tagged with a process id (this one's by default), for a side folder only that
    process uses: :func:`orphans` finds it once the process is gone."""
    return f"{prefix}{os.getpid() if pid is None else pid}-"


def orphans(parent: str | Path, prefix: str, *, min_age_s: float = 0.0) -> list[Path]:
    """The folders in ``parent`` named by :func:`pid_prefix` with ``prefix`` whose process is gone
    (killed before it could remove them), sorted. A pid in use again counts as alive: kept.
    ``min_age_s``: only folders unchanged for that long (a folder shared with another pid namespace,
    a container's ``/tmp``, may belong to a live process this one cannot see)."""
    found, now = [], time.time()
    for path in sorted(Path(parent).glob(f"{glob.escape(prefix)}*-*")):
        pid = path.name[len(prefix):].split("-", 1)[0]
        try:
            fresh = now - path.stat().st_mtime < min_age_s
        except OSError:
            continue
        if pid.isdigit() and path.is_dir() and not fresh and not pid_alive(int(pid)):
            found.append(path)
    return found


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def staged_dir(out: str | Path, key: str, *, replaces: Callable[[Path], bool],
               error: type[EaglenestError] = StoreError) -> Iterator[Path]:
    """A fresh folder beside ``out`` to write a whole output in; when the block succeeds it becomes
    ``out``, when it fails (or the process is killed) ``out`` is as it was. An earlier ``out`` is
    replaced only if ``replaces(out)`` says it is an earlier output of the same kind (moved aside,
    removed once the new one is in place); any other non-empty folder is ``error`` naming ``key``,
    never deleted. Side folders a killed writer left (``.<name>.tmp-<pid>-*``, ``.<name>.old-<pid>-*``)
    are swept first, an earlier output moved aside put back if ``out`` is missing."""
    out = check_output_dir(out, key, replaces=replaces, error=error)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for kind in ("old", "tmp"):  # an earlier output moved aside goes back before anything else
            for side in orphans(out.parent, f".{out.name}.{kind}-"):
                if kind == "old" and not out.exists():
                    os.replace(side, out)
                else:
                    shutil.rmtree(side, ignore_errors=True)
        if out.is_dir() and any(out.iterdir()) and not replaces(out):
            raise error(f"{key}: {shown_path(out)} is a folder of other files; give an empty or new folder")
        tmp = Path(tempfile.mkdtemp(prefix=pid_prefix(f".{out.name}.tmp-"), dir=out.parent))
        os.chmod(tmp, 0o777 & ~umask())  # a folder as mkdir makes it, not mkdtemp's owner-only one
    except OSError as exc:
        raise _refusal(exc, out, key, error) from None
    try:
        yield tmp
        try:
            install_dir(tmp, out)
        except OSError as exc:
            raise _refusal(exc, out, key, error) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_output_dir(out: str | Path, key: str, *, replaces: Callable[[Path], bool],
                     error: type[EaglenestError] = StoreError) -> Path:
    """What :func:`staged_dir` refuses, checked before long work (nothing is left behind): ``out`` a
    file, a folder of other files, or a place that cannot be written. Returns ``out`` as a Path."""
    out = user_path(out, key, error=error, resolve=False)
    if out.is_symlink():  # an output kept elsewhere (another disk): replaced there, the link stays
        out = user_path(out, key, error=error)
    if out.name in ("", ".", ".."):  # the current, a parent or the root folder: never replaced whole
        raise error(f"{key}: {shown_path(out)} names no folder of its own; give a new folder, e.g. out/model")
    if out.exists() and not out.is_dir():
        raise error(f"{key}: {shown_path(out)} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not replaces(out):
        raise error(f"{key}: {shown_path(out)} is a folder of other files; give an empty or new folder")
    ensure_writable(out.parent, key, error=error, keep=False)
    return out


def umask() -> int:
    """The process's umask (read by setting one and putting it back): the modes a plain write gives."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def install_dir(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; an earlier, non-empty ``out`` is moved aside
    (``.<name>.old-<pid>-*``) and removed only once the new one is in place (put back if that fails)."""
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)  # new, or an empty folder (a rename replaces it)
        return
    old = Path(tempfile.mkdtemp(prefix=pid_prefix(f".{out.name}.old-"), dir=out.parent))
    try:
        os.replace(out, old)
    except OSError:  # ``out`` cannot be moved (a mount point, the current folder): no empty side folder left
        old.rmdir()
        raise
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_json_object(path: str | Path, *, error: type[EaglenestError], then: str) -> dict:
    """The JSON object in the file ``path`` (one the project wrote: a draft's config.json, a
    checkpoint's record); a file that is not valid JSON, or not an object, is ``error`` in one line
    naming the file and ending with ``then`` (what to do about it)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise error(f"{path}: not valid JSON ({str(exc).splitlines()[0][:120]}); {then}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object; {then}")
    return data
