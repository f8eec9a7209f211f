"""Thin, validated access to the store's Lance tables: append, read a pinned version, tag.

A store is a LanceDB directory; each table is a Lance dataset ``<uri>/<name>.lance``. Every write
is one Lance commit (atomic: a reader sees all of it or none of it) and is validated against the
declared schema first. Reads name a version so a finished run can be replayed on identical data.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S

log = logging.getLogger(__name__)

PROMPTS = "prompts"
FEATURES = "features"


def _lance():
    from eaglenest.errors import require

    return require("lance", "featurestore")


def table_path(uri: str, name: str) -> Path:
    return Path(uri) / f"{name}.lance"


def exists(uri: str, name: str) -> bool:
    return (table_path(uri, name) / "_versions").is_dir()


def is_features(name: str) -> bool:
    """Every table but ``prompts`` holds one feature set (``featurestore.table``, default features)."""
    return name != PROMPTS


def expected_schema(name: str, meta: S.FeatureMeta | None = None) -> pa.Schema:
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise StoreError(f"bad table name '{name}': use letters, digits, '_' or '-' (featurestore.table)")
    if name == PROMPTS:
        return S.PROMPTS_SCHEMA
    if meta is None:
        raise SchemaError(f"writing features table '{name}' needs its FeatureMeta")
    return S.features_schema(meta)


def append(uri: str, name: str, table: pa.Table, *, meta: S.FeatureMeta | None = None,
           lineage: dict | None = None) -> int:
    """Validate ``table`` and append it as one commit (creating the table). Returns the new version.

    The single-writer case of :mod:`eaglenest.featurestore.fragments` (write fragments, one commit).
    """
    from eaglenest.featurestore import fragments

    frags = fragments.write_fragment(uri, name, table, meta=meta)
    version = fragments.commit_fragments(uri, name, frags, meta=meta, lineage=lineage)
    log.debug("appended %d rows to %s (version %d)", table.num_rows, table_path(uri, name), version)
    return version


def dataset(uri: str, name: str, version: int | str | None = None):
    """Open a table at ``version`` (a number or a tag; latest when None), validating its schema."""
    lance = _lance()
    if not exists(uri, name):
        raise StoreError(f"no table '{name}' in store {uri}")
    try:
        ds = lance.dataset(str(table_path(uri, name)), version=version)
    except (ValueError, OSError) as exc:
        raise StoreError(f"table '{name}' in {uri}: cannot open version {version!r} ({exc})") from None
    base = S.PROMPTS_SCHEMA if name == PROMPTS else S.FEATURES_SCHEMA
    # A version number past the latest, or an unknown tag, is a user error, not a traceback.
    S.validate(ds.schema, base, what=f"table '{name}'")
    return ds


def latest_version(uri: str, name: str) -> int:
    return dataset(uri, name).version


#: Scanner option that returns the bytes of blob columns (features schema 2), not (position, size).
BYTES = {"blob_handling": "all_binary"}


def read(uri: str, name: str, *, version: int | str | None = None, columns: list[str] | None = None,
         filter: str | None = None) -> pa.Table:
    """A table version as Arrow (tensor columns as bytes; training reads use featurestore.reader)."""
    return dataset(uri, name, version).to_table(columns=columns, filter=filter, **BYTES)


def iter_batches(uri: str, name: str, *, version: int | str | None = None,
                 columns: list[str] | None = None, filter: str | None = None,
                 batch_size: int = 64) -> Iterator[pa.RecordBatch]:
    ds = dataset(uri, name, version)
    yield from ds.to_batches(columns=columns, filter=filter, batch_size=batch_size, **BYTES)


def sample_ids(uri: str, name: str, *, filter: str | None = None) -> set[str]:
    """Ids already in a table (empty if the table does not exist yet): what a resumed run skips."""
    if not exists(uri, name):
        return set()
    return set(read(uri, name, columns=["sample_id"], filter=filter).column("sample_id").to_pylist())


def tag(uri: str, name: str, tag_name: str, version: int) -> None:
    ds = dataset(uri, name)
    if tag_name in ds.tags.list():
        ds.tags.update(tag_name, version)
    else:
        ds.tags.create(tag_name, version)
