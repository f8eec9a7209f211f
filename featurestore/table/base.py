"""The bottom of the table room: locating and opening a store's tables, and the head record.

A store is a LanceDB directory, local or on an object store (``s3://bucket/prefix``; reached
through :mod:`eaglenest.featurestore.table.objects`, docs/storage.md); each table is a Lance dataset
``<uri>/<name>.lance``. This module maps table names (checked by
:mod:`~eaglenest.featurestore.table.names`) to paths, opens a table at a version (validating its
schema, refusing a rolled-back latest), keeps the head record that detects a rollback, and reads
whole versions as Arrow. Everything above it in ``table/`` (lease,
integrity, fragments, versions, maintenance) builds on these; :mod:`~eaglenest.featurestore.table.store`
is the facade the stages use. Trade-off: one module holds all the low-level pieces so that the
modules above share them without importing each other (or the facade).
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError, require
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import objects
from eaglenest.featurestore.table.names import FEATURES, NAME, PROMPTS, check_name, check_tag, is_features

log = logging.getLogger(__name__)

__all__ = ["BYTES", "FEATURES", "HEAD_FILE", "PROMPTS", "check_name", "check_tag", "dataset", "exists",
           "expected_schema", "head_version", "is_features", "iter_batches", "latest_version", "read",
           "record_head", "require_lance", "rolled_back", "sample_ids", "sql_text", "table_names", "table_path",
           "table_uri", "tag_list", "unreadable"]


def require_lance():
    """The ``lance`` module (an ImportError naming the extra when it is missing)."""
    return require("lance")


def table_path(uri: str, name: str) -> Path:
    """The table's directory in a local store (object stores: :func:`table_uri`)."""
    if objects.is_remote(uri):
        raise StoreError(f"table '{name}' in {uri}: not a local directory (internal: use table_uri)")
    return Path(objects.local(uri)) / f"{check_name(name)}.lance"


def table_uri(uri: str, name: str) -> str:
    """The table's location as Lance and pyarrow take it (a local path or an object-store URI)."""
    return objects.join(uri, f"{check_name(name)}.lance")


def exists(uri: str, name: str) -> bool:
    return objects.exists(objects.join(table_uri(uri, name), "_versions"), directory=True)


def must_exist(uri: str, name: str, what: str) -> None:
    """Refuse ``what`` (a maintenance verb) on a table of a store that is not there (a mistyped path), before
    its lease files would make a store folder of it. A store that is there goes on to the table's lease: a
    capture writing the table's first version holds it, and says so ("being written by")."""
    if not exists(uri, name) and not objects.exists(uri, directory=True):
        raise StoreError(f"no table '{name}' in store {uri}; {what} changed nothing")


def table_names(uri: str) -> list[str]:
    """Names of the tables in the store (directories ``<name>.lance`` holding a version)."""
    names = sorted(e.name[:-len(".lance")] for e in objects.listdir(uri)
                   if not e.is_file and e.name.endswith(".lance") and NAME.fullmatch(e.name[:-len(".lance")]))
    return [n for n in names if exists(uri, n)]


def expected_schema(name: str, meta: S.FeatureMeta | None = None) -> pa.Schema:
    check_name(name)
    if name == PROMPTS:
        return S.PROMPTS_SCHEMA
    if meta is None:
        raise SchemaError(f"writing features table '{name}' needs its FeatureMeta")
    return S.features_schema(meta)


def whole_number(value) -> int | None:
    """``value`` as an int when it is a whole number (numpy integers too); None for a bool (``True == 1``),
    a float (``1.5``) or anything else: a row or version number given so is refused, not truncated."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _version_arg(uri: str, name: str, version) -> int | str | None:
    """``version`` as Lance takes it: None, a tag, or a version number (a numpy integer as an int). A bool
    or a float is refused in one line rather than opened as another version (Lance reads ``True`` as
    version 1, and reports a numpy integer as a damaged manifest)."""
    if version is None or isinstance(version, str):
        return version
    if (number := whole_number(version)) is not None:
        return number
    raise StoreError(f"table '{name}' in {uri}: version {version!r} is not a version number or a tag "
                     f"({type(version).__name__}; `featurestore versions` lists them)")


def _missing_version(uri: str, name: str, version: int | str | None) -> str | None:
    """The line for a version number or tag the table does not have (None: it has it, or the table
    cannot be listed): Lance's own error names its internal files and source lines instead."""
    if version is None:
        return None
    try:
        latest = objects.dataset(table_uri(uri, name))
        numbers = [v["version"] for v in latest.versions()]
        tags = latest.tags.list()
    except LANCE_ERRORS:
        return None
    if isinstance(version, int) and version not in numbers:
        return _missing_number(uri, name, version, numbers)
    if isinstance(version, str) and version not in tags:
        return (f"table '{name}' in {uri} has no tag '{version[:80]}' "
                f"(tags: {', '.join(sorted(tags)) or 'none'}; `featurestore tags` lists them)")
    return None


def _missing_number(uri: str, name: str, version: int, numbers: list[int]) -> str:
    """The line for version number ``version`` that is not among the table's ``numbers``. Lance
    numbers versions 1, 2, ... without gaps, so one below the latest that is gone was removed by
    ``featurestore gc``: said so, with the oldest version kept."""
    if numbers and 1 <= version < max(numbers):
        return (f"table '{name}' in {uri} no longer has version {version}: it was garbage-collected "
                f"(`featurestore gc`; the oldest version kept is {min(numbers)}, the latest {max(numbers)}; "
                "`featurestore versions` lists them, and a tag keeps a version from gc)")
    return (f"table '{name}' in {uri} has no version {version} (the latest is "
            f"{max(numbers, default='none')}; `featurestore versions` lists them)")


#: Where Lance's messages name its own Rust source (", /home/runner/.../sql.rs:109:30"): noise to a user.
_RUST_SOURCE = re.compile(r",?\s*/\S+\.rs:\d+(:\d+)?:?")


def lance_line(exc: BaseException) -> str:
    """The first line of a Lance error, without the Rust source locations it appends (300 chars at most)."""
    text = _RUST_SOURCE.sub("", str(exc).splitlines()[0] if str(exc) else "").strip()
    return text[:300] or type(exc).__name__


def _cannot_open(uri: str, name: str, version: int | str | None, exc: BaseException) -> str:
    """The line for a version Lance cannot open: its manifest (the newest one, for the latest) is
    damaged, truncated or gone, or, for a tag, the tag's file; Lance's own text says which file,
    without its Rust source lines."""
    what = "its latest version" if version is None else f"version {version!r}"
    files = f"{name}.lance/_versions" if not isinstance(version, str) else f"{name}.lance/_refs/tags or _versions"
    return (f"table '{name}' in {uri}: cannot open {what} ({lance_line(exc)}); a file under {files} is "
            "damaged or missing: restore it from a backup")


#: What Lance raises for a table it cannot open or list (RuntimeError: a damaged manifest).
LANCE_ERRORS = (ValueError, OSError, RuntimeError)


def version_list(ds, uri: str, name: str) -> list[dict]:
    """``ds.versions()``, every manifest of the table; one that is damaged is a :class:`StoreError`
    naming it (Lance's message does), not a traceback."""
    try:
        return ds.versions()
    except LANCE_ERRORS as exc:
        first = lance_line(exc)
        raise StoreError(f"table '{name}' in {uri}: cannot list its versions ({first}); a manifest under "
                         f"{name}.lance/_versions is damaged: restore it from a backup") from None


def tag_list(ds, uri: str, name: str) -> dict:
    """``ds.tags.list()``, every tag of the table; a damaged tag file is a :class:`StoreError` naming
    the tags folder, not Lance's ``RuntimeError`` (``show``, ``versions``, ``tags`` and ``gc`` list them)."""
    try:
        return ds.tags.list()
    except LANCE_ERRORS as exc:
        raise StoreError(f"table '{name}' in {uri}: cannot read its tags ({lance_line(exc)}); a file under "
                         f"{name}.lance/_refs/tags is damaged: restore it from a backup, or delete that file "
                         "(its tag is lost, the version stays)") from None


def dataset(uri: str, name: str, version: int | str | None = None, *, allow_rolled_back: bool = False):
    """Open a table at ``version`` (a number or a tag; latest when None), validating its schema.

    The latest version of a table that has been rolled back (a committed version's manifest is
    gone; see :func:`rolled_back`) is refused: reading it would silently lose that version's rows.
    """
    if not exists(uri, name):
        raise StoreError(f"no table '{name}' in store {uri}")
    version = _version_arg(uri, name, version)
    # RuntimeError: a damaged manifest ("Encountered corrupt file <path>"); OverflowError: a version number
    # Lance's unsigned 64-bit versions cannot hold (-1, 2**64), from a caller that did not check it.
    try:
        ds = objects.dataset(table_uri(uri, name), version)
    except (*LANCE_ERRORS, OverflowError) as exc:
        raise StoreError(_missing_version(uri, name, version) or _cannot_open(uri, name, version, exc)) from None
    base = S.PROMPTS_SCHEMA if name == PROMPTS else S.FEATURES_SCHEMA
    # A version number past the latest, or an unknown tag, is a user error, not a traceback.
    S.validate(ds.schema, base, what=f"table '{name}'")
    if version is None and not allow_rolled_back:
        problem = rolled_back(uri, name, ds.version)
        if problem:
            raise StoreError(problem)
    return ds


# -- the head record: the newest version eaglenest committed, to detect a table rolled back ------
#
# Lance finds a table's latest version by listing ``_versions/``. Delete the newest manifest and
# the table silently opens at the one before, its rows gone. So every commit eaglenest makes (under
# the table's writer lease) also records its version in ``<table>.lance/_eaglenest_head.json``;
# a latest version older than that record (or than Lance's own ``latest_version_hint.json``) means
# a committed version was lost. ``featurestore restore --v N`` accepts such a rollback explicitly.
# On an object store the record is one PUT (atomic); without leases there, two writers may write
# it in either order, so it can lag (a missed detection), never run ahead (a false alarm).

HEAD_FILE = "_eaglenest_head.json"


def head_version(uri: str, name: str) -> int | None:
    """The newest version eaglenest recorded committing (None: no record)."""
    text = objects.read_text(objects.join(table_uri(uri, name), HEAD_FILE))
    try:
        return int(json.loads(text)["version"])
    except (ValueError, KeyError, TypeError, OverflowError):  # garbled (1e400 reads as inf): no record
        return None


def record_head(uri: str, name: str, version: int, *, force: bool = False) -> None:
    """Record ``version`` as committed (the larger of it and the record, unless ``force``)."""
    have = head_version(uri, name)
    if have is not None and have >= version and not force:
        return
    objects.write_text(objects.join(table_uri(uri, name), HEAD_FILE), json.dumps({"version": int(version)}))


def rolled_back(uri: str, name: str, latest: int) -> str | None:
    """A message if a version newer than ``latest`` was committed and its manifest is gone."""
    recorded = head_version(uri, name)
    hint = None
    try:
        hint = int(json.loads(objects.read_text(objects.join(table_uri(uri, name), "_versions",
                                                             "latest_version_hint.json")))["version"])
    except (ValueError, KeyError, TypeError, OverflowError):
        pass
    newest = max(v for v in (recorded, hint, latest) if v is not None)
    if newest <= latest:
        return None
    # A writer may have committed (manifest, then record) between the caller's listing and the
    # record read above: that is a newer version, not a lost one. List again before saying so.
    try:
        if objects.dataset(table_uri(uri, name)).version >= newest:
            return None
    except (ValueError, OSError):
        pass
    return (f"table '{name}' in {uri} is rolled back: version {newest} was committed but the newest "
            f"manifest is version {latest} (a file under {name}.lance/_versions was deleted?). Its rows "
            f"are not readable; restore the manifest from a backup, or accept the loss with "
            f"`featurestore restore --v {latest}`")


def latest_version(uri: str, name: str) -> int:
    return dataset(uri, name).version


def sql_text(value: str) -> str:
    """``value`` as an SQL string literal for a Lance filter: a quote in it is text, not syntax
    (``split = {sql_text(s)}``)."""
    return "'" + str(value).replace("'", "''") + "'"


#: Scanner option that returns the bytes of blob columns (features schema 2), not (position, size).
BYTES = {"blob_handling": "all_binary"}


def read(uri: str, name: str, *, version: int | str | None = None, columns: list[str] | None = None,
         filter: str | None = None) -> pa.Table:
    """A table version as Arrow (tensor columns as bytes; training reads use featurestore.read.reader)."""
    ds = dataset(uri, name, version)
    check_columns(ds, name, columns)
    with unreadable(uri, name, ds.version, filter=filter):
        return ds.to_table(columns=columns, filter=filter, **BYTES)


def check_columns(ds, name: str, columns: list[str] | None) -> None:
    """Refuse reading columns table ``name`` does not have (a table written by an older eaglenest, or
    by another tool) in one line naming them, not Lance's schema error."""
    missing = [c for c in columns or () if c not in ds.schema.names]
    if missing:
        raise SchemaError(f"table '{name}' version {ds.version} has no column {', '.join(map(repr, missing))} "
                          f"(it has {', '.join(ds.schema.names)}); was it written by another tool or an older "
                          "eaglenest?")


def iter_batches(uri: str, name: str, *, version: int | str | None = None,
                 columns: list[str] | None = None, filter: str | None = None,
                 batch_size: int = 64, bounded: bool = False) -> Iterator[pa.RecordBatch]:
    """The rows in batches of ``batch_size``. ``bounded``: one batch read ahead, not Lance's default
    of many (tensor rows: Lance would otherwise hold tens of batches in memory ahead of the reader)."""
    ds = dataset(uri, name, version)
    check_columns(ds, name, columns)
    ahead = {"batch_readahead": 1, "fragment_readahead": 1, "io_buffer_size": 32 << 20} if bounded else {}
    with unreadable(uri, name, ds.version, filter=filter):
        yield from ds.to_batches(columns=columns, filter=filter, batch_size=batch_size, **ahead, **BYTES)


@contextlib.contextmanager
def unreadable(uri: str, name: str, version: int, *, filter: str | None = None):
    """A Lance read failure (a missing, truncated or corrupt data file) as one line naming the
    table and version, pointing at ``featurestore verify`` (which names the fragment and file). A
    ``filter`` Lance refuses (a column the table lacks, a value of the wrong type, bad SQL) is one
    line naming the filter: Lance raises a bare ``ValueError`` that ends in its Rust source lines."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        first = lance_line(exc)
        raise StoreError(f"table '{name}' in {uri}, version {version}: cannot read it ({first}); "
                         "`featurestore verify` names the damaged fragment and file") from None
    except ValueError as exc:
        if filter is None:
            raise
        raise StoreError(f"table '{name}' in {uri}: the filter {filter[:200]!r} is refused "
                         f"({lance_line(exc)})") from None


def sample_ids(uri: str, name: str, *, filter: str | None = None) -> set[str]:
    """Ids already in a table (empty if the table does not exist yet): what a resumed run skips."""
    if not exists(uri, name):
        return set()
    return set(read(uri, name, columns=["sample_id"], filter=filter).column("sample_id").to_pylist())
