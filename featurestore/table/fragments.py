"""Many writers, one commit: write Lance fragments anywhere, append them in one atomic commit.

The pattern Lance documents for distributed writes: each worker (a process, a Dask task) calls
:func:`write_fragment`, which validates its rows against the declared schema and writes data files
under the table directory **without** committing; it returns small picklable
``FragmentMetadata``. One driver gathers them and calls :func:`commit_fragments`: one
``LanceOperation.Append`` commit, so readers see all of the fragments or none of them.

Trade-offs:

* Fragments written but never committed are invisible garbage; ``featurestore gc`` removes them
  once they are older than its grace period, and never while a writer holds the table's lease.
* The table is created empty (schema and feature metadata only) on first use, atomically: on local
  disk written aside and renamed into place under a per-table create lock; on an object store
  written in place, Lance's conditional PUT of the first manifest letting one creator win.
* Every commit is refused if it would store a ``sample_id`` twice, and the check and the commit are
  one step: on local disk under the table's writer lease (``featurestore/table/lease.py``); on an
  object store, where there is no lease, through Lance's commit protocol (:func:`_serial_append`):
  the commit is a Lance operation that Lance does not rebase over another writer's commit, so if
  anything landed after the version the check read, Lance refuses the commit (its manifest is
  written with a conditional PUT) and it is re-checked against the new version and retried.
  Conflicts are retried with jittered backoff.
* Lineage (manifest hash, code version, parent version, counts per domain) is written into the
  commit's Lance transaction properties under ``eaglenest.lineage``, so it is atomic with the data
  and read back per version by :mod:`eaglenest.featurestore.table.versions`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
import uuid
from pathlib import Path

import pyarrow as pa

from eaglenest import faults
from eaglenest.config import short_text
from eaglenest.errors import SchemaError, StoreError, require
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import base, integrity, lease, objects

log = logging.getLogger(__name__)

LINEAGE_KEY = "eaglenest.lineage"


def _checked(uri: str, name: str, table: pa.Table, meta: S.FeatureMeta | None) -> tuple[pa.Table, pa.Schema]:
    want = base.expected_schema(name, meta)
    if problem := _column_problem(table.schema.names, want.names):  # it would be dropped or picked silently
        raise SchemaError(f"write to '{name}': {problem}; nothing was written")
    S.validate(table.schema, want, what=f"write to '{name}'")
    if problem := null_problem(table, want):  # before the cast, whose error names no row
        raise SchemaError(f"write to '{name}': {problem}; nothing was written")
    table = table.select(want.names).cast(want)
    if problem := id_problem(table.column("sample_id")):
        raise SchemaError(f"write to '{name}': {problem}; nothing was written")
    if name != base.PROMPTS and (problem := S.row_problem(table, meta)):  # before a byte is written
        raise SchemaError(f"write to '{name}': {problem}; nothing was written")
    return table, want


def null_problem(table: pa.Table, want: pa.Schema) -> str | None:
    """The first null the table's schema does not store, by column and row (None: none): a cell of a
    column that takes no nulls, or an item of a list column (a token id, a loss-mask value)."""
    import pyarrow.compute as pc

    for field in want:
        col = table.column(field.name)
        if not field.nullable and col.null_count:
            return f"column '{field.name}' is null in row {_first_true(pc.is_null(col))}"
        if pa.types.is_list(field.type):
            col = col.combine_chunks()
            items = pc.list_flatten(col)
            if items.null_count:
                row = pc.list_parent_indices(col)[_first_true(pc.is_null(items))].as_py()
                return f"column '{field.name}' holds a null item in row {row}"
    return None


def _first_true(mask) -> int:
    return int(mask.to_numpy(zero_copy_only=False).nonzero()[0][0])


#: A line break or another control character (Unicode Cc, Zl, Zp): a sample id holding one would break
#: every one-line error naming it and ``featurestore query`` output.
_CONTROL = r"[\x00-\x1f\x7f-\x9f\x{2028}\x{2029}]"


def id_problem(ids) -> str | None:
    """The first sample id that is missing, empty or holds a control character, by row (None: none)."""
    import pyarrow.compute as pc

    bad = pc.or_kleene(pc.equal(pc.utf8_length(ids), 0), pc.match_substring_regex(ids, _CONTROL))
    bad = pc.fill_null(bad, True).to_numpy(zero_copy_only=False).nonzero()[0]
    if not len(bad):
        return None
    k = int(bad[0])
    value = ids[k].as_py()
    what = "is missing" if value is None else "is empty" if not value else \
        f"'{short_text(value, 60)}' holds a control character (sample ids are one-line text)"
    return f"row {k}: sample_id {what}"


def _column_problem(names: list[str], wanted: list[str]) -> str | None:
    """A column given twice or one the table does not store (None: neither)."""
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        return f"column '{twice[0]}' is given {names.count(twice[0])} times"
    extra = [c for c in names if c not in wanted]
    if extra:
        return (f"column(s) {', '.join(repr(c) for c in extra[:5])} are not stored by this table "
                f"(its columns: {', '.join(wanted)}); drop them or keep them in a table of your own")
    return None


def check_identity(ds, name: str, meta: S.FeatureMeta | None) -> None:
    """Refuse to mix feature sets in one table, naming what differs and the key to change."""
    if not base.is_features(name):
        return
    version = S.schema_version(ds.schema)
    if version != S.SCHEMA_VERSION:
        raise SchemaError(
            f"table '{name}' is features schema version {version} ({S.tensor_layout(ds.schema)} tensor columns); "
            f"this eaglenest writes version {S.SCHEMA_VERSION} and does not mix the two in one table. "
            "It can still be read and trained on; to add rows, capture into a new table "
            "(featurestore.table) or a new store (run.store)")
    if name != base.FEATURES:
        return
    have = S.feature_meta(ds.schema)
    if have == meta:
        return
    diff = [f for f in ("target", "layer_ids", "last_layer_id", "hidden_size", "dtype", "storage", "feature_set_id")
            if getattr(have, f) != getattr(meta, f)]
    raise SchemaError(
        f"table '{name}' holds another feature set (differs in {', '.join(diff)}: "
        f"{ {f: getattr(have, f) for f in diff} } vs { {f: getattr(meta, f) for f in diff} }); "
        "set featurestore.table to a new table name or run.store to a new store")


def write_fragment(uri: str, name: str, table: pa.Table, *, meta: S.FeatureMeta | None = None) -> list:
    """Validate ``table`` and write it as data files of table ``name``; no commit.

    Safe in another process or a Dask worker. Returns ``FragmentMetadata`` objects (picklable, a few
    hundred bytes each) for :func:`commit_fragments`.
    """
    fragment = require("lance.fragment")
    table, want = _checked(uri, name, table, meta)
    if table.num_rows == 0:
        return []
    ensure_table(uri, name, meta=meta)  # refuses another feature set before any byte is written
    path = base.table_uri(uri, name)
    frags = fragment.write_fragments(table, path, schema=want, storage_options=objects.lance_options(uri))
    log.debug("wrote %d fragment(s), %d rows, for %s", len(frags), table.num_rows, path)
    return list(frags)


def ensure_table(uri: str, name: str, *, meta: S.FeatureMeta | None = None) -> int:
    """Create ``name`` empty (schema + metadata) if missing; returns its latest version.

    Creation is atomic: under a short per-table lock, the empty table is written to a temporary
    directory inside the store and renamed into place, so no reader or writer ever sees a table
    directory without its first manifest (two writers creating a table at once both succeed, and
    the table has one empty first version).
    """
    want = base.expected_schema(name, meta)
    if not base.exists(uri, name):
        with lease.create_lock(uri, name):
            if not base.exists(uri, name):
                _create(uri, name, want)
    ds = base.dataset(uri, name, allow_rolled_back=True)
    check_identity(ds, name, meta)
    return ds.version


def _create(uri: str, name: str, want: pa.Schema) -> None:
    lance = base.require_lance()
    if objects.is_remote(uri):
        _create_remote(lance, uri, name, want)
        return
    path = base.table_path(uri, name)
    if path.exists():
        if any(path.iterdir()):
            raise StoreError(f"table '{name}' in {uri}: {path} exists but holds no table version "
                             "(an interrupted create by an older eaglenest?); move it away and re-run")
        path.rmdir()
    tmp = Path(objects.local(uri)) / ".eaglenest" / "tmp" / f"{name}.{uuid.uuid4().hex}.lance"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        # File format 2.0: Lance's default (2.2 in pylance 14) wrote the large_binary tensor columns
        # ~10x slower (bench/featurestore_write.py); later fragments inherit the table's format.
        lance.write_dataset(want.empty_table(), str(tmp), schema=want, mode="create", data_storage_version="2.0")
        os.rename(tmp, path)
    except OSError as exc:
        raise StoreError(f"run.store: cannot create table '{name}' in {uri} "
                         f"({base.lance_line(exc)[:300]})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base.record_head(uri, name, 1)
    log.debug("created %s", path)


def _create_remote(lance, uri: str, name: str, want: pa.Schema) -> None:
    """Create the table in place on an object store: no rename there, but Lance writes the first
    manifest with a conditional PUT (``If-None-Match``), so of two creators one wins and the other
    finds the table (docs/storage.md)."""
    path = base.table_uri(uri, name)
    try:
        lance.write_dataset(want.empty_table(), path, schema=want, mode="create", data_storage_version="2.0",
                            storage_options=objects.lance_options(uri))
    except (OSError, ValueError) as exc:
        if not base.exists(uri, name):
            raise StoreError(f"run.store: cannot create table '{name}' in {uri} "
                             f"({base.lance_line(exc)[:300]})") from None
        log.debug("table %s was created by another writer meanwhile", path)
        return
    base.record_head(uri, name, 1)
    log.debug("created %s", path)


def _is_conflict(exc: Exception) -> bool:
    text = str(exc).lower()
    return "conflict" in text or "retry" in text or "concurrent" in text


def fragment_sample_ids(uri: str, name: str, fragments: list, ds) -> list[str]:
    """``sample_id`` of every row of (uncommitted) ``fragments`` of table ``ds``, read from their data files."""
    from lance.file import LanceFileReader

    table_dir = base.table_uri(uri, name)
    field = ds.lance_schema.field("sample_id").id()
    ids: list[str] = []
    for frag in fragments:
        files = [f for f in frag.files if field in f.fields]
        if len(files) != 1:
            raise StoreError(f"fragment of table '{name}': no single data file holds sample_id")
        path = objects.join(table_dir, "data", files[0].path)
        try:
            t = LanceFileReader(path, storage_options=objects.lance_options(uri),
                                columns=["sample_id"]).read_all().to_table()
        except (OSError, ValueError) as exc:
            raise StoreError(f"table '{name}': cannot read the uncommitted data file {path} "
                             f"({base.lance_line(exc)[:200]}); was it deleted?") from None
        ids += t.column("sample_id").to_pylist()
    return ids


def duplicates(ids: list[str], existing: set[str]) -> list[str]:
    """Ids of ``ids`` already in ``existing`` or repeated within ``ids`` (sorted, unique)."""
    seen, dup = set(), set()
    for i in ids:
        if i in existing or i in seen:
            dup.add(i)
        seen.add(i)
    return sorted(dup)


def commit_fragments(uri: str, name: str, fragments: list, *, meta: S.FeatureMeta | None = None,
                     max_retries: int = 5, lineage: dict | None = None) -> int:
    """One Lance Append commit of ``fragments`` (creating the table if needed); returns the version.

    Made under the table's writer lease (``featurestore/table/lease.py``; re-entered when the caller
    already holds it, as capture and ingest do): the commit is refused, with nothing changed, when
    the table was rolled back or when a ``sample_id`` of the new rows is already in the table or
    repeated among them. So no sample is ever stored twice, whatever the writers do. Commit
    conflicts with writers outside eaglenest are retried up to ``max_retries`` times with jittered
    exponential backoff. ``lineage`` (JSON-able) is stored in the commit's transaction properties;
    ``parent_version`` is filled in with the version the commit was made on top of.

    On an object store there is no lease: the commit is made with :func:`_serial_append`, which Lance
    refuses when another commit landed after the version the check read; the loop then re-reads the
    table and checks again, so the loser of two racing writers is refused (its ids are stored) or
    commits after the winner (they are not). No version ever holds a ``sample_id`` twice.
    """
    lance = base.require_lance()
    if name == base.FEATURES and meta is None:
        raise SchemaError("committing features needs its FeatureMeta")
    ensure_table(uri, name, meta=meta)
    if not fragments:  # workers that wrote no rows: no version, as store.append of no rows makes none
        return base.dataset(uri, name).version  # (a rolled-back table is refused, as a commit would be)
    path = base.table_uri(uri, name)
    remote = objects.is_remote(uri)
    with lease.hold(uri, name, purpose="commit", wait_s=lease.WAIT_S):
        new_ids = None
        for attempt in range(max_retries + 1):
            ds = base.dataset(uri, name)  # refuses a rolled-back table
            if new_ids is None:
                new_ids = fragment_sample_ids(uri, name, fragments, ds)
            existing = set(ds.to_table(columns=["sample_id"]).column("sample_id").to_pylist())
            dup = duplicates(new_ids, existing)
            if dup:
                raced = "; a concurrent writer committed them first" if attempt else ""
                raise StoreError(f"commit to table '{name}' refused: {len(dup)} sample id(s) would be stored "
                                 f"twice (e.g. {', '.join(dup[:3])}); nothing was committed "
                                 f"(latest version {ds.version} unchanged){raced}")
            props = {}
            if lineage is not None:
                props[LINEAGE_KEY] = json.dumps({**lineage, "parent_version": ds.version}, sort_keys=True,
                                                default=str)
            op = _serial_append(ds, fragments) if remote else lance.LanceOperation.Append(list(fragments))
            tx = lance.Transaction(read_version=ds.version, operation=op, transaction_properties=props)
            faults.delay("featurestore.commit_after_check")  # tests: two unleased writers in this window
            try:
                new = lance.LanceDataset.commit(path, tx, storage_options=objects.lance_options(uri))
            except OSError as exc:
                if not _is_conflict(exc) or attempt == max_retries:
                    raise StoreError(f"commit to table '{name}' failed after {attempt + 1} attempt(s): "
                                     f"{base.lance_line(exc)[:300]}") from None
                delay = min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random())
                log.info("commit conflict on %s (attempt %d), retrying in %.2fs", path, attempt + 1, delay)
                time.sleep(delay)
                continue
            try:
                base.record_head(uri, name, new.version)
                integrity.record_checksums(uri, name, fragments)
            except OSError as exc:
                raise StoreError(f"table '{name}': version {new.version} was committed, but its head record or "
                                 f"checksums could not be written ({exc.strerror or exc}); fix the store, "
                                 "then run `featurestore verify`") from None
            log.debug("committed %d fragment(s) to %s as version %d", len(fragments), path, new.version)
            return new.version
    raise AssertionError("unreachable")


def _serial_append(ds, fragments: list):
    """An append that Lance serializes with every other commit: for object stores, which have no lease.

    Lance rebases an ``Append`` over any number of concurrent Appends, so a duplicate check made on
    version N would not hold for the version the rows land in. A ``Merge`` whose fragment list is
    version N's fragments plus the new ones adds the same rows with the same schema (new fragments
    get fresh ids from Lance, as an Append's do), but Lance does not rebase it over a concurrent
    Append, Delete, Rewrite or Merge: the commit fails with a retryable conflict instead, and the
    caller re-checks against the newer version. The conflict is decided by Lance's commit protocol
    (a conditional PUT of the next manifest on S3), so nothing of ours can be left behind."""
    lance = base.require_lance()
    existing = [f.metadata for f in ds.get_fragments()]
    return lance.LanceOperation.Merge(existing + list(fragments), ds.lance_schema)


#: The lineage of versions ``gc`` may have removed (their transaction files go with them), kept beside
#: the table: ``{"<version>": lineage}``. What reads a table's history (the on-policy guard's record of
#: which target generated the prompts) reads it too.
GC_LINEAGE_FILE = "_eaglenest_gc_lineage.json"


def removed_lineage(uri: str, name: str) -> dict[int, dict]:
    """The lineage ``gc`` kept of the versions it was about to remove (empty: none, or unreadable)."""
    text = objects.read_text(objects.join(base.table_uri(uri, name), GC_LINEAGE_FILE))
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        found = {}
    if not isinstance(found, dict):
        return {}
    return {int(k): v for k, v in found.items() if k.isascii() and k.isdigit() and isinstance(v, dict)}


def keep_lineage(uri: str, name: str, ds, versions: list[int]) -> None:
    """Record the lineage of ``versions`` of ``ds`` (those a ``gc`` may remove) in :data:`GC_LINEAGE_FILE`,
    before they are removed: a gc killed after removing them has kept it."""
    found = {v: lin for v in versions if (lin := lineage_of(ds, v))}
    if not found:
        return
    kept = {**removed_lineage(uri, name), **found}
    objects.write_text(objects.join(base.table_uri(uri, name), GC_LINEAGE_FILE),
                       json.dumps({str(v): kept[v] for v in sorted(kept)}, sort_keys=True))


def lineage_of(ds, version: int) -> dict | None:
    """The lineage recorded with ``version`` (None for versions written without one)."""
    tx = ds.read_transaction(version)
    raw = (tx.transaction_properties or {}).get(LINEAGE_KEY) if tx is not None else None
    if not raw:
        return None
    try:
        found = json.loads(raw)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        # written by another tool or damaged: say so, keep listing the store
        log.warning("version %d: its lineage record is not a JSON object (%r); ignoring it", version, raw[:80])
        return {"unreadable": raw[:200]}
    return found
