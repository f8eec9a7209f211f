"""Many writers, one commit: write Lance fragments anywhere, append them in one atomic commit.

The pattern Lance documents for distributed writes: each worker (a process, a Dask task) calls
:func:`write_fragment`, which validates its rows against the declared schema and writes data files
under the table directory **without** committing; it returns small picklable
``FragmentMetadata``. One driver gathers them and calls :func:`commit_fragments`: one
``LanceOperation.Append`` commit, so readers see all of the fragments or none of them.

Trade-offs:

* Fragments written but never committed are invisible garbage; ``featurestore gc`` (Lance's
  ``cleanup_old_versions`` with ``delete_unverified``) removes them once they are old.
* The table is created empty (schema and feature metadata only) on first use, with Lance's
  ``mode="create"``, which fails atomically if another writer won the race; the loser then appends.
  Two Appends never conflict in Lance (it rebases them); anything that does conflict (a concurrent
  schema change, compaction) is retried with jittered exponential backoff.
* Lineage (manifest hash, code version, parent version, counts per domain) is written into the
  commit's Lance transaction properties under ``eaglenest.lineage``, so it is atomic with the data
  and read back per version by :mod:`eaglenest.featurestore.versions`.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore import store

log = logging.getLogger(__name__)

LINEAGE_KEY = "eaglenest.lineage"


def _checked(uri: str, name: str, table: pa.Table, meta: S.FeatureMeta | None) -> tuple[pa.Table, pa.Schema]:
    want = store.expected_schema(name, meta)
    S.validate(table.schema, want, what=f"write to '{name}'")
    return table.select(want.names).cast(want), want


def check_identity(ds, name: str, meta: S.FeatureMeta | None) -> None:
    """Refuse to mix feature sets in one table, naming what differs and the key to change."""
    if not store.is_features(name):
        return
    version = S.schema_version(ds.schema)
    if version != S.SCHEMA_VERSION:
        raise SchemaError(
            f"table '{name}' is features schema version {version} ({S.tensor_layout(ds.schema)} tensor columns); "
            f"this eaglenest writes version {S.SCHEMA_VERSION} and does not mix the two in one table. "
            "It can still be read and trained on; to add rows, capture into a new table "
            "(featurestore.table) or a new store (run.store)")
    if name != store.FEATURES:
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
    from eaglenest.errors import require

    fragment = require("lance.fragment", "featurestore")
    table, want = _checked(uri, name, table, meta)
    if table.num_rows == 0:
        return []
    ensure_table(uri, name, meta=meta)  # refuses another feature set before any byte is written
    path = store.table_path(uri, name)
    frags = fragment.write_fragments(table, str(path), schema=want)
    log.debug("wrote %d fragment(s), %d rows, for %s", len(frags), table.num_rows, path)
    return list(frags)


def ensure_table(uri: str, name: str, *, meta: S.FeatureMeta | None = None) -> int:
    """Create ``name`` empty (schema + metadata) if missing; returns its latest version."""
    lance = store._lance()
    want = store.expected_schema(name, meta)
    path = store.table_path(uri, name)
    if not store.exists(uri, name):
        Path(uri).mkdir(parents=True, exist_ok=True)
        try:
            # File format 2.0: Lance's default (2.2 in pylance 14) wrote the large_binary tensor columns
            # ~10x slower (bench/featurestore_write.py); later fragments inherit the table's format.
            lance.write_dataset(want.empty_table(), str(path), schema=want, mode="create",
                                data_storage_version="2.0")
        except OSError as exc:
            if "already exists" not in str(exc) and not store.exists(uri, name):
                raise
            log.debug("another writer created %s first", path)
    for attempt in range(50):  # another writer may be between creating the directory and its manifest
        try:
            ds = store.dataset(uri, name)
            break
        except StoreError:
            if attempt == 49:
                raise
            time.sleep(0.05)
    check_identity(ds, name, meta)
    return ds.version


def _is_conflict(exc: Exception) -> bool:
    text = str(exc).lower()
    return "conflict" in text or "retry" in text or "concurrent" in text


def commit_fragments(uri: str, name: str, fragments: list, *, meta: S.FeatureMeta | None = None,
                     max_retries: int = 5, lineage: dict | None = None) -> int:
    """One Lance Append commit of ``fragments`` (creating the table if needed); returns the version.

    Commit conflicts are retried up to ``max_retries`` times with jittered exponential backoff.
    ``lineage`` (JSON-able) is stored in the commit's transaction properties; ``parent_version``
    is filled in with the version the commit was made on top of.
    """
    lance = store._lance()
    if name == store.FEATURES and meta is None:
        raise SchemaError("committing features needs its FeatureMeta")
    ensure_table(uri, name, meta=meta)
    path = str(store.table_path(uri, name))
    for attempt in range(max_retries + 1):
        ds = lance.dataset(path)
        props = {}
        if lineage is not None:
            props[LINEAGE_KEY] = json.dumps({**lineage, "parent_version": ds.version}, sort_keys=True,
                                            default=str)
        tx = lance.Transaction(read_version=ds.version, operation=lance.LanceOperation.Append(list(fragments)),
                               transaction_properties=props)
        try:
            new = lance.LanceDataset.commit(path, tx)
        except OSError as exc:
            if not _is_conflict(exc) or attempt == max_retries:
                raise StoreError(f"commit to table '{name}' failed after {attempt + 1} attempt(s): {exc}") from exc
            delay = min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random())
            log.info("commit conflict on %s (attempt %d), retrying in %.2fs", path, attempt + 1, delay)
            time.sleep(delay)
            continue
        from eaglenest.featurestore.maintenance import record_checksums

        record_checksums(uri, name, fragments)
        log.debug("committed %d fragment(s) to %s as version %d", len(fragments), path, new.version)
        return new.version
    raise AssertionError("unreachable")


def lineage_of(ds, version: int) -> dict | None:
    """The lineage recorded with ``version`` (None for versions written without one)."""
    tx = ds.read_transaction(version)
    raw = (tx.transaction_properties or {}).get(LINEAGE_KEY) if tx is not None else None
    return json.loads(raw) if raw else None
