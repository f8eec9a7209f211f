"""Thin, validated access to the store's Lance tables: append, read a pinned version, tag.

The facade the stages use (``from eaglenest.featurestore.table import store``). A store is a
LanceDB directory, local or on an object store (``s3://bucket/prefix``; opened through
:mod:`eaglenest.featurestore.table.objects`, docs/storage.md); each table is a Lance dataset
``<uri>/<name>.lance``. Every write is one Lance commit (atomic: a reader sees all of it or none of
it) and is validated against the declared schema first. Reads name a version so a finished run can
be replayed on identical data. The pieces live below it in ``table/`` (names, paths, opening and
the head record in :mod:`~eaglenest.featurestore.table.base`; commits in
:mod:`~eaglenest.featurestore.table.fragments`; tags in :mod:`~eaglenest.featurestore.table.versions`)
and are re-exported here; nothing in ``table/`` imports this module.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import fragments, versions
from eaglenest.featurestore.table.base import (
    BYTES,
    FEATURES,
    HEAD_FILE,
    PROMPTS,
    check_name,
    check_tag,
    dataset,
    exists,
    expected_schema,
    head_version,
    is_features,
    iter_batches,
    latest_version,
    read,
    record_head,
    rolled_back,
    sample_ids,
    sql_text,
    table_names,
    table_path,
    table_uri,
    tag_list,
    unreadable,
    version_list,
)

__all__ = ["BYTES", "FEATURES", "HEAD_FILE", "PROMPTS", "append", "check_name", "check_tag", "dataset", "exists",
           "expected_schema", "head_version", "is_features", "iter_batches", "latest_version", "read",
           "record_head", "rolled_back", "sample_ids", "sql_text", "table_names", "table_path", "table_uri", "tag",
           "tag_list", "unreadable", "version_list"]

log = logging.getLogger(__name__)


def append(uri: str, name: str, table: pa.Table, *, meta: S.FeatureMeta | None = None,
           lineage: dict | None = None) -> int:
    """Validate ``table`` and append it as one commit (creating the table). Returns the new version;
    ``table`` with no rows is validated and makes no version (returns the latest: nothing to add).

    The single-writer case of :mod:`eaglenest.featurestore.table.fragments` (write fragments, one commit).
    """
    frags = fragments.write_fragment(uri, name, table, meta=meta)
    if not frags:
        fragments.ensure_table(uri, name, meta=meta)
        version = dataset(uri, name).version  # refuses a rolled-back table, as a commit would
        log.debug("nothing to append to %s: 0 rows (version %d unchanged)", table_uri(uri, name), version)
        return version
    version = fragments.commit_fragments(uri, name, frags, meta=meta, lineage=lineage)
    log.debug("appended %d rows to %s (version %d)", table.num_rows, table_uri(uri, name), version)
    return version


def tag(uri: str, name: str, tag_name: str, version: int) -> None:
    versions.set_tag(uri, name, tag_name, version)
