"""Read-only SQL over the store's tables with DuckDB (``featurestore query "SELECT ..."``).

Each table in the store is registered under its name (``prompts``, ``features``, ...) at the
latest version, or at a pinned one. Tensor columns (``aux_hidden``, ``last_hidden``) are left out
unless asked for: they are 24+ KiB per token and no aggregate needs them. Extra files (Parquet/CSV,
e.g. per-sample evaluation results) can be attached as tables for joins.

Only a single SELECT (or WITH ... SELECT) statement runs: DuckDB parses the text and anything else
(INSERT, COPY, ATTACH, CREATE, PRAGMA, several statements) is refused before execution; the
connection is in-memory and, once the tables are registered, external file access is switched off,
so a SELECT cannot read or write other files either.

Trade-off: the non-tensor columns of each table are materialised in memory as Arrow (ids, masks,
lengths: a few bytes per token), which keeps joins and self-joins simple; the tensor columns are
streamed from Lance only when requested.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store

log = logging.getLogger(__name__)


def check_read_only(sql: str) -> None:
    import duckdb

    try:
        stmts = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise ConfigError(f"query: cannot parse SQL ({str(exc).splitlines()[0]})") from None
    if len(stmts) != 1:
        raise ConfigError(f"query: exactly one statement allowed, got {len(stmts)}")
    kind = stmts[0].type
    if kind != duckdb.StatementType.SELECT:
        raise ConfigError(f"query: only SELECT/WITH statements are allowed (read-only), got {kind.name}")


def tables_in(uri: str) -> list[str]:
    return store.table_names(uri)  # a local directory or an object-store prefix


def connect(uri: str, *, versions: dict[str, int | str] | None = None, with_tensors: bool = False,
            attach: dict[str, str] | None = None):
    """An in-memory DuckDB connection with the store's tables (and ``attach`` files) registered."""
    import duckdb

    con = duckdb.connect(":memory:")
    for name in tables_in(uri):
        ds = store.dataset(uri, name, (versions or {}).get(name))
        cols = [c for c in ds.schema.names if with_tensors or c not in S.TENSOR_COLUMNS]
        con.register(name, ds.to_table(columns=cols, **store.BYTES))  # blob columns as bytes
    for name, path in (attach or {}).items():
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"query: attached file {path} does not exist")
        fn = "read_parquet" if p.suffix == ".parquet" else "read_csv_auto" if p.suffix == ".csv" else "read_json_auto"
        if not name.isidentifier():
            raise ConfigError(f"query: attached table name '{name}' must be an identifier")
        con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM {fn}('{_q(str(p))}')")
    con.execute("SET enable_external_access = false")
    return con


def _q(text: str) -> str:
    return text.replace("'", "''")


def run_query(uri: str, sql: str, **kw) -> pa.Table:
    """Run one read-only statement; returns an Arrow table."""
    check_read_only(sql)
    con = connect(uri, **kw)
    try:
        result = con.sql(sql)
        return result.to_arrow_table() if result is not None else pa.table({})
    except Exception as exc:
        raise StoreError(f"query failed: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()


def loss_token_counts(uri: str, name: str, *, version: int | str | None, split: str, vocab_size: int):
    """int64 [vocab_size]: occurrences of each token id where loss_mask = 1, by a SQL aggregate."""
    import numpy as np

    sql = (f"SELECT id, count(*) AS n FROM (SELECT unnest(input_ids) AS id, unnest(loss_mask) AS m "
           f"FROM {name} WHERE split = '{_q(split)}') WHERE m = 1 GROUP BY id")
    t = run_query(uri, sql, versions={name: version})
    counts = np.zeros(vocab_size, dtype=np.int64)
    ids = t.column("id").to_numpy()
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(f"features: token id outside the target vocab [0, {vocab_size})")
    counts[ids] = t.column("n").to_numpy()
    return counts
