"""Where a store lives: a local directory or an object store, reached through one small helper.

A store URI is a local path (``runs/toy/store``) or an object-store URI (``s3://bucket/prefix``,
``gs://...``, ``az://...``; docs/storage.md). Every Lance call of the feature store opens its
dataset through :func:`dataset` / :func:`lance_options`, so the recipe's ``run.storage_options``
(non-secret settings such as an endpoint) reach Lance on every open, write and commit; credentials
come from the standard environment variables, which Lance and pyarrow read themselves.

The few files eaglenest keeps beside a table (the head record, CRC sidecars) go through
:func:`read_text` / :func:`write_text`: on local disk a write is a temporary file renamed into
place, on an object store one PUT, which is atomic (a reader sees the old object or the new one).
Listing, sizes and modification times (``gc``'s sweep of uncommitted files) come from
``pyarrow.fs``, built from the same options. Trade-off: pyarrow and Lance each keep their own
connection pool to the store; sharing one would need Lance's object-store internals.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from pathlib import Path

from eaglenest.errors import StoreError, require
from eaglenest.runconfig import REMOTE_SCHEMES, storage_options_for, store_key_problem


def scheme(uri: str) -> str:
    """``s3`` for ``s3://b/p``; ``""`` for a local path (``file://`` included)."""
    text = str(uri)
    if "://" not in text:
        return ""
    s = text.split("://", 1)[0].lower()
    return "" if s == "file" else s


def is_remote(uri: str) -> bool:
    return scheme(uri) != ""


def local(uri: str) -> str:
    """A local store URI as a plain path (``file:///x`` -> ``/x``)."""
    text = str(uri)
    return text[len("file://"):] if text[:len("file://")].lower() == "file://" else text  # as scheme()


def join(uri: str, *parts: str) -> str:
    """``uri`` / parts, as a string Lance and pyarrow accept (no ``//`` inside an object key)."""
    if not is_remote(uri):
        return str(Path(local(uri), *parts))
    return "/".join([str(uri).rstrip("/"), *(p.strip("/") for p in parts)])


def check_key(uri: str) -> None:
    """Refuse an object-store URI whose key Lance and pyarrow would read differently (or not at all):
    :func:`eaglenest.runconfig.store_key_problem`, checked when a recipe loads and again here for URIs
    built in code."""
    if problem := store_key_problem(uri):
        raise StoreError(problem)


def lance_options(uri: str) -> dict[str, str] | None:
    """Lance ``storage_options`` for ``uri``: the recipe's, resolved (None for local paths)."""
    if not is_remote(uri):
        return None
    check_key(uri)
    return storage_options_for(str(uri)) or None


def dataset(path: str, version: int | str | None = None):
    """``lance.dataset`` of a table URI, with its store's storage options."""
    lance = require("lance")
    return lance.dataset(path if is_remote(path) else local(path), version=version,
                         storage_options=lance_options(path))


# -- side files and listings through pyarrow.fs ---------------------------------------------------

#: The environment variables an S3 filesystem is built from: part of its cache key, so a process
#: whose environment changes (a long-lived Dask worker, a test session) never reuses a stale client.
S3_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_REGION", "AWS_DEFAULT_REGION",
          "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _first(opts: dict, *keys: str, env: tuple[str, ...] = ()) -> str | None:
    for k in keys:
        if opts.get(k):
            return opts[k]
    for e in env:
        if opts.get(f"_env_{e}"):
            return opts[f"_env_{e}"]
    return None


@functools.lru_cache(maxsize=16)
def _filesystem(kind: str, frozen: tuple):
    import pyarrow.fs as pafs

    opts = dict(frozen)  # with the S3_ENV variables as "_env_<name>" (filesystem() adds them)
    if kind == "s3":
        endpoint = _first(opts, "aws_endpoint", "endpoint", "aws_endpoint_url", "endpoint_url",
                          env=("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
        kw = {"region": _first(opts, "aws_region", "region", env=("AWS_REGION", "AWS_DEFAULT_REGION"))}
        if any(k in opts for k in ("aws_access_key_id", "access_key_id", "aws_secret_access_key", "secret_access_key")):
            # Explicit credentials (an option may name one, the environment the other): pyarrow needs both.
            kw["access_key"] = _first(opts, "aws_access_key_id", "access_key_id", env=("AWS_ACCESS_KEY_ID",))
            kw["secret_key"] = _first(opts, "aws_secret_access_key", "secret_access_key", env=("AWS_SECRET_ACCESS_KEY",))
            kw["session_token"] = _first(opts, "aws_session_token", "session_token", env=("AWS_SESSION_TOKEN",))
        if endpoint:
            http = endpoint.startswith("http://")
            kw["endpoint_override"] = endpoint.split("://", 1)[-1].rstrip("/")
            kw["scheme"] = "http" if http else "https"
        return pafs.S3FileSystem(**{k: v for k, v in kw.items() if v is not None})
    # gs:// and az://: pyarrow's defaults (credentials from the environment, docs/storage.md).
    fs, _ = pafs.FileSystem.from_uri(f"{kind}://{opts.get('_bucket', '')}")
    return fs


def filesystem(uri: str):
    """``(pyarrow FileSystem, path inside it)`` for a file or directory URI of a store."""
    import pyarrow.fs as pafs

    kind = scheme(uri)
    if not kind:
        return pafs.LocalFileSystem(), str(Path(local(uri)).absolute())
    if kind not in REMOTE_SCHEMES:
        raise StoreError(f"run.store: {kind}:// stores are not supported (use {', '.join(REMOTE_SCHEMES)}:// "
                         "or a local path)")
    check_key(uri)
    opts = storage_options_for(str(uri))
    rest = str(uri).split("://", 1)[1]
    if kind != "s3":
        opts = {**opts, "_bucket": rest.split("/", 1)[0]}
    else:
        opts = {**opts, **{f"_env_{e}": os.environ[e] for e in S3_ENV if os.environ.get(e)}}
    return _filesystem(kind, tuple(sorted(opts.items()))), rest.rstrip("/")


def read_text(uri: str) -> str | None:
    """A small file's text; None when it does not exist or cannot be read locally (or is not UTF-8
    text); a StoreError when an object store cannot be reached (that is not "no file")."""
    if not is_remote(uri):
        try:
            return Path(local(uri)).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
    fs, path = filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    except OSError as exc:  # the store is down or refuses us: not the same as no file
        raise _unreachable(uri, exc) from None


def write_text(uri: str, text: str) -> None:
    """Write a small file atomically: temp file + rename locally, one PUT on an object store."""
    if not is_remote(uri):
        path = Path(local(uri))
        # Per thread too: the writer lease is re-entrant within a process, so two threads may write at once.
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return
    fs, path = filesystem(uri)
    try:
        with fs.open_output_stream(path) as f:  # a single PUT below the multipart threshold
            f.write(text.encode())
    except OSError as exc:
        raise _unreachable(uri, exc) from None


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    size: int
    mtime_s: float | None
    is_file: bool


def listdir(uri: str) -> list[Entry]:
    """The direct children of a directory (empty if it does not exist)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    except FileNotFoundError:
        return []
    except OSError as exc:
        if not is_remote(uri):
            return []
        raise _unreachable(uri, exc) from None
    if not infos and is_remote(uri):
        check_bucket(fs, path, uri)
    return [Entry(i.base_name, int(i.size or 0), i.mtime.timestamp() if i.mtime else None,
                  i.type == pafs.FileType.File) for i in infos]


def exists(uri: str, *, directory: bool = False) -> bool:
    """Whether ``uri`` is a file (or, with ``directory``, a directory / a non-empty prefix)."""
    if not is_remote(uri):
        p = Path(local(uri))
        return p.is_dir() if directory else p.is_file()
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    try:
        kind = fs.get_file_info(path).type
    except OSError as exc:
        raise _unreachable(uri, exc) from None
    if kind == pafs.FileType.NotFound:
        check_bucket(fs, path, uri)
    return kind == (pafs.FileType.Directory if directory else pafs.FileType.File)


def _unreachable(uri: str, exc: OSError) -> StoreError:
    return StoreError(f"run.store: cannot reach {uri} ({' '.join(str(exc).split())[:200]})")


def check_bucket(fs, path: str, uri: str) -> None:
    """Nothing found under ``path``: a missing bucket is the user's error to fix, not an empty store."""
    import pyarrow.fs as pafs

    bucket = path.split("/", 1)[0]
    try:
        missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except OSError:  # e.g. a policy scoped to a prefix may refuse HeadBucket: say nothing more
        return
    if missing:
        raise StoreError(f"run.store: {uri}: bucket '{bucket}' does not exist (or these credentials cannot "
                         "see it): create it, or fix the bucket name or run.storage_options")


def delete(uri: str) -> None:
    """Delete a file; FileNotFoundError if it is gone (a concurrent sweep), StoreError if the store is not reachable."""
    fs, path = filesystem(uri)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _unreachable(uri, exc) from None



def delete_tree(uri: str) -> None:
    """Delete every object under the prefix ``uri`` (an object store's directory), and the directory
    markers pyarrow leaves when a prefix empties; StoreError if the store is not reachable."""
    fs, path = filesystem(uri)
    try:
        fs.delete_dir(path)
    except FileNotFoundError:  # a concurrent delete got there first
        return
    except OSError as exc:
        raise _unreachable(uri, exc) from None
