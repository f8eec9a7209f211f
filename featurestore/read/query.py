"""Read-only SQL over the store's tables with DuckDB (``featurestore query "SELECT ..."``).

Each table in the store is registered under its name (``prompts``, ``features``, ...) at the
latest version, or at a pinned one. Tensor columns (``aux_hidden``, ``last_hidden``) are left out
unless asked for: they are 24+ KiB per token and no aggregate needs them. Extra files (Parquet/CSV,
e.g. per-sample evaluation results) can be attached as tables for joins.

Only a single SELECT (or WITH ... SELECT) statement runs: DuckDB parses the text and anything else
(INSERT, COPY, ATTACH, CREATE, PRAGMA, several statements) is refused before execution; the
connection is in-memory and, once the tables are registered, external file access is switched off,
so a SELECT cannot read or write other files either.

Only the tables the statement names are registered (read from DuckDB's own parse tree, nothing
bound or run): a query of ``prompts`` neither checks nor reads ``features``.

No table is materialised: each is registered as a view of its Lance dataset (:func:`_view`) that
DuckDB scans batch by batch (about :data:`BATCH_BYTES` of the columns the query reads, tensor
values as bytes), once per reference in the query, reading only the columns it asks for. So an
aggregate over ``input_ids`` of a large store holds a few batches, not every token id
(``bench/featurestore_query_memory.py --small``); the tensor columns are there only with
``with_tensors``. :func:`write_query`
streams the result into the output file batch by batch, so ``featurestore query --with-tensors
--out f.parquet`` holds a few batches, whatever the table's size (``bench/featurestore_query_memory.py``).
A query with a blocking operator over tensor columns (``ORDER BY`` of the rows, an aggregate that
keeps them) still needs DuckDB to hold what that operator holds.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from eaglenest.config import short_text
from eaglenest.errors import ConfigError, StoreError, require
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import integrity, objects, store
from eaglenest.paths import pid_alive, shown_path, user_path
from eaglenest.provenance import write_provenance

log = logging.getLogger(__name__)

#: About how many bytes of tensor columns one batch of a streamed query holds (rows are never split).
BATCH_BYTES = 8 * 2**20
#: ``--attach NAME=FILE``: NAME is a plain SQL identifier; FILE is read by its suffix.
ATTACH_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
#: DuckDB's readers by suffix (the Python API's, which take an open file: see :func:`_attach_file`).
READERS = {".parquet": "read_parquet", ".csv": "read_csv", ".json": "read_json", ".jsonl": "read_json"}
#: How much of a DuckDB error (which may echo the query's text) the one-line error keeps.
ERROR_CHARS = 300


def check_read_only(sql: str) -> None:
    import duckdb

    try:
        stmts = duckdb.extract_statements(sql)
    except duckdb.Error as exc:
        raise ConfigError(f"query: cannot parse SQL ({short_text(str(exc).splitlines()[0], ERROR_CHARS)})") from None
    if len(stmts) != 1:
        raise ConfigError(f"query: exactly one statement allowed, got {len(stmts)}")
    kind = stmts[0].type
    if kind != duckdb.StatementType.SELECT:
        raise ConfigError(f"query: only SELECT/WITH statements are allowed (read-only), got {kind.name}")


def named_tables(sql: str) -> set[str] | None:
    """The (lower-cased) names the statement reads as tables, CTE names included, from DuckDB's parse
    tree (``json_serialize_sql``: parsed, not bound, so nothing is looked up or read); None when
    DuckDB cannot serialise it (then every table is registered)."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        (tree,), = con.execute("SELECT json_serialize_sql(?::VARCHAR)", [sql]).fetchall()
    except duckdb.Error:
        return None
    finally:
        con.close()
    root = json.loads(tree)
    if root.get("error"):
        return None
    names, todo = set(), [root]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if node.get("type") == "BASE_TABLE" and isinstance(node.get("table_name"), str):
                names.add(node["table_name"].lower())
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return names


def tables_in(uri: str) -> list[str]:
    return store.table_names(uri)  # a local directory or an object-store prefix


def connect(uri: str, *, versions: dict[str, int | str] | None = None, with_tensors: bool = False,
            attach: dict[str, str] | None = None, only: set[str] | None = None):
    """An in-memory DuckDB connection with the store's tables (those in ``only``, lower-cased, when
    given) and ``attach`` files registered."""
    return _connect(uri, versions=versions, with_tensors=with_tensors, attach=attach, only=only)[0]


def _connect(uri: str, *, versions: dict[str, int | str] | None = None, with_tensors: bool = False,
             attach: dict[str, str] | None = None, only: set[str] | None = None, opened: dict | None = None):
    """:func:`connect`, and how many rows of the tensor tables make a batch (None: no tensors);
    ``opened`` (when given) gets each registered table's version number."""
    import duckdb

    names = tables_in(uri)
    unknown = sorted(set(versions or {}) - set(names))
    if unknown:  # a pin the query would otherwise drop without a word, reading the latest of everything
        raise StoreError(f"query: a version is pinned for table '{unknown[0]}', which the store {uri} does not "
                         f"have (tables: {', '.join(names) or 'none'}; featurestore.table names the table "
                         "--version pins)")
    _check_attach(attach or {}, names)  # before any table is read
    con = duckdb.connect(":memory:")
    try:
        batch_rows = None
        for name in names:
            if only is not None and name.lower() not in only and name not in (versions or {}):
                continue  # not named by the statement (a pinned one is still opened: its version is checked)
            # Every data file held to its CRC first (one stat each once stamped): a damaged file is one
            # line naming it, not rows read back silently or a Lance traceback.
            ds = integrity.checked_dataset(uri, name, (versions or {}).get(name))
            with store.unreadable(uri, name, ds.version):
                view = _view(uri, ds, tensors=with_tensors)  # scanned batch by batch, never materialised
                if with_tensors and any(c in S.TENSOR_COLUMNS for c in ds.schema.names):
                    rows = _rows_per_batch(ds, [c for c in ds.schema.names if c in S.TENSOR_COLUMNS])
                    batch_rows = min(batch_rows or rows, rows)
                con.register(name, view)
            if opened is not None:
                opened[name] = int(ds.version)
        for name, path in (attach or {}).items():
            try:
                _attach_file(con, name, path)
            except (duckdb.Error, OSError) as exc:  # not the format its suffix says, damaged, unreadable
                raise ConfigError(f"{_attach_item(name, path)}: cannot read it "
                                  f"({short_text(str(exc).splitlines()[0], ERROR_CHARS)})") from None
        con.execute("SET enable_external_access = false")
    except BaseException:
        con.close()
        raise
    return con, batch_rows


def _attach_file(con, name: str, path: str) -> None:
    """Table ``name`` holding the rows of the file at ``path``, read through an open file: DuckDB takes
    a path holding ``[``, ``*`` or ``?`` for a glob pattern, so ``res[1].parquet`` read ``res1.parquet``
    and ``a*.parquet`` every file it matches, silently (and escaping them fails on a ``\\`` in the path)."""
    with open(path, "rb") as f:
        rows = getattr(con, READERS[Path(path).suffix])(f)
        con.register("_eaglenest_attach", rows)
        try:
            con.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM _eaglenest_attach")
        finally:
            con.unregister("_eaglenest_attach")


def _attach_item(name: str, path: str) -> str:
    """``--attach NAME=FILE`` for an error line: bounded, the end of the path kept (its file name)."""
    return f"--attach {short_text(name, 40)}={shown_path(path)}"


def _check_attach(attach: dict[str, str], tables: list[str]) -> None:
    """Refuse an ``--attach NAME=FILE`` DuckDB would: a name that is no plain identifier, a SQL
    keyword or a store table's, a file that is not there or not .parquet/.csv/.json/.jsonl."""
    import duckdb

    reserved = {k for (k,) in duckdb.sql("SELECT keyword_name FROM duckdb_keywords() "
                                         "WHERE keyword_category = 'reserved'").fetchall()}
    for name, path in attach.items():
        item = _attach_item(name, path)
        if not ATTACH_NAME.fullmatch(name) or name.lower() in reserved:
            raise ConfigError(f"{item}: the name must be a plain identifier (letters, digits, '_'; "
                              "not a SQL keyword)")
        if name.lower() in {t.lower() for t in tables}:
            raise ConfigError(f"{item}: '{name}' is a table of the store already (tables: "
                              f"{', '.join(tables)}); attach the file under another name")
        if Path(path).suffix not in READERS:
            raise ConfigError(f"{item}: use a .parquet, .csv, .json or .jsonl file")
        # a name too long, a NUL: one line (``is_file`` raises on those)
        if not user_path(path, f"--attach {short_text(name, 40)}", error=ConfigError, resolve=False).is_file():
            raise ConfigError(f"{item}: no such file")


def _rows_per_batch(ds, columns: list[str]) -> int:
    """Rows of ``ds`` holding about :data:`BATCH_BYTES` of ``columns``, judged by its largest row (the most
    ``num_tokens``; the first row of a table without that column). Rows of one table differ in length a
    thousandfold (1K to 32K tokens): judged by a short first row, one batch held the whole table."""
    lance = require("lance")
    where = {}
    if "num_tokens" in ds.schema.names:  # one small column scanned: about 4 bytes a row
        tokens = lance.LanceDataset.scanner(ds, columns=["num_tokens"]).to_table().column("num_tokens")
        if len(tokens):
            where = {"filter": f"num_tokens = {int(pc.max(tokens).as_py())}"}
    row = lance.LanceDataset.scanner(ds, columns=columns, limit=1, **where, **store.BYTES).to_table()
    return max(1, BATCH_BYTES // max(1, row.nbytes)) if row.num_rows else 1


def _view(uri: str, ds, *, tensors: bool):
    """Table ``ds`` (a Lance dataset at a fixed version) as a source DuckDB scans batch by batch; its
    tensor columns shown only with ``tensors``.

    DuckDB scans a ``pyarrow.dataset.Dataset`` by calling its ``scanner(columns=, filter=)`` once
    per reference in the query and reading ``to_reader()`` of what it returns. Lance's own scanner
    would hand it the tensor columns' blob descriptors (not the bytes) and cannot run every filter
    DuckDB pushes down, and pyarrow's ``Scanner.from_batches`` reads ahead without bound (measured:
    peak memory grew with the table). So the view reads the requested columns (and those the
    filter names) from Lance, bytes and about :data:`BATCH_BYTES` at a time, and applies DuckDB's
    filter and projection to each batch itself (:class:`_Batches`).
    """
    lance = require("lance")
    shown = pa.schema([f for f in ds.schema if tensors or f.name not in S.TENSOR_COLUMNS])

    class View(lance.LanceDataset):
        @property
        def schema(self) -> pa.Schema:
            return shown

        def scanner(self, columns=None, filter=None, **_):
            want = list(columns) if columns is not None else shown.names
            # A pushed-down filter may name a column the projection leaves out (IS NOT NULL).
            named = str(filter) if filter is not None else ""
            read = [c for c in shown.names if c in want or c in named]
            rows = _rows_per_batch(self, read) if read else 1 << 16
            inner = lance.LanceDataset.scanner(self, columns=read, batch_size=rows, batch_readahead=1,
                                               fragment_readahead=1, io_buffer_size=2 * BATCH_BYTES, **store.BYTES)
            return _Batches(inner.to_reader(), want, filter)

    return View(ds.uri, version=ds.version, storage_options=objects.lance_options(uri))


class _Batches:
    """What :func:`_view`'s ``scanner`` returns: Lance's batches, filtered and projected."""

    def __init__(self, reader: pa.RecordBatchReader, columns: list[str], filter):
        self._reader, self._filter = reader, filter
        self.projected_schema = pa.schema([reader.schema.field(c) for c in columns])

    def to_reader(self) -> pa.RecordBatchReader:
        def batches():
            for batch in self._reader:
                if self._filter is not None:
                    batch = batch.filter(self._filter)
                yield batch.select(self.projected_schema.names)

        return pa.RecordBatchReader.from_batches(self.projected_schema, batches())


def run_query(uri: str, sql: str, **kw) -> pa.Table:
    """Run one read-only statement; returns an Arrow table."""
    check_read_only(sql)
    con = connect(uri, only=named_tables(sql), **kw)
    try:
        result = con.sql(sql)
        return result.to_arrow_table() if result is not None else pa.table({})
    except Exception as exc:
        raise _failed(exc, uri, kw.get("with_tensors", False)) from None
    finally:
        con.close()


def preview_query(uri: str, sql: str, *, max_rows: int, **kw) -> pa.Table:
    """The rows a printout truncated to ``max_rows`` shows (pandas: the first and the last
    ``max_rows // 2``), read batch by batch: the first ``max_rows // 2 + 1`` rows and the last as
    many after them; every row of a result no longer than that. So printing ``SELECT *`` with
    tensors holds those rows, not the table, and the printout is the one of the whole result."""
    keep = max_rows // 2 + 1
    check_read_only(sql)
    con, batch_rows = _connect(uri, only=named_tables(sql), **kw)
    if batch_rows is not None:
        con.execute("SET threads = 2")  # each DuckDB thread holds a batch in flight
    head, tail, in_head, in_tail = [], collections.deque(), 0, 0
    try:
        reader = con.sql(sql).to_arrow_reader(batch_rows or 100_000)
        for batch in reader:
            take = min(batch.num_rows, keep - in_head)
            if take:
                head.append(batch.slice(0, take))
                in_head += take
            if batch.num_rows > take:
                tail.append(batch.slice(take))
                in_tail += batch.num_rows - take
            while in_tail > keep:  # drop what lies before the last rows (a slice keeps its batch's memory)
                extra = in_tail - keep
                if tail[0].num_rows <= extra:
                    in_tail -= tail.popleft().num_rows
                else:
                    tail[0], in_tail = tail[0].slice(extra), keep
        return pa.Table.from_batches([*head, *tail], schema=reader.schema)
    except Exception as exc:  # DuckDB's errors (binder, conversion) as one line
        raise _failed(exc, uri, kw.get("with_tensors", False)) from None
    finally:
        con.close()


def _failed(exc: BaseException, uri: str, with_tensors: bool) -> StoreError:
    """A DuckDB error as one bounded line (it may echo the query), with the hint it calls for."""
    import duckdb

    # A Lance error inside the tensor view arrives wrapped, with Python's traceback after "Detail:".
    text = (str(exc).splitlines() or [type(exc).__name__])[0].split(" Detail: Python exception:")[0]
    hint = ""
    if isinstance(exc, duckdb.CatalogException) and "does not exist" in text:
        hint = (f"; the store {uri} has tables: {', '.join(tables_in(uri)) or 'none'} (run.store or "
                "run.workdir picks the store; `featurestore capture` writes the features table)")
    elif not with_tensors and isinstance(exc, duckdb.BinderException) and \
            any(f'"{c}"' in text for c in S.TENSOR_COLUMNS):
        hint = f"; the tensor columns ({', '.join(S.TENSOR_COLUMNS)}) are there only with --with-tensors"
    elif "LanceError" in text:
        hint = "; `featurestore verify` names the damaged fragment and file"
    return StoreError(f"query failed: {short_text(text, ERROR_CHARS)}{hint}")


def write_query(uri: str, sql: str, out: str | Path, *, config: dict | None = None, **kw) -> int:
    """Run one read-only statement and stream its result into ``out`` (``.parquet`` or ``.csv``)
    batch by batch; returns the number of rows. The file appears whole or not at all: it is
    written beside ``out`` under a temporary name and renamed into place; a refused or failed
    query leaves nothing, and the temporary file of a run that was killed (SIGKILL, the OOM killer)
    is removed by the next write of the same ``out``.

    ``config`` (the command's resolved recipe): ``out``'s provenance is written beside it, in
    :func:`provenance_path` (the statement, the store, the version of each table it read, attached
    files), once the result is in place. A sidecar of its own, not the folder's ``provenance.json``:
    two results in one folder would otherwise share one record, the last query's."""
    out = Path(out)
    if out.suffix not in (".parquet", ".csv"):
        raise ConfigError(f"--out {out}: use a .csv or .parquet file name")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    check_read_only(sql)
    opened: dict[str, int] = {}  # the version of each table the statement reads (for the provenance)
    con, batch_rows = _connect(uri, only=named_tables(sql), opened=opened, **kw)
    if batch_rows is not None:
        con.execute("SET threads = 2")  # each DuckDB thread holds a batch in flight
    tmp = temp_path(out)
    _remove_stale_temps(out)
    rows = 0
    try:
        try:
            reader = con.sql(sql).to_arrow_reader(batch_rows or 100_000)
            if out.suffix == ".csv":
                _check_csv_columns(reader.schema, out)
            with _writer(tmp, out.suffix, reader.schema) as write:
                for batch in reader:
                    write(batch)
                    rows += batch.num_rows
            os.replace(tmp, out)
            if config is not None:
                _write_provenance(out, config=config, inputs={
                    "store": uri, "tables": opened, "attach": dict(kw.get("attach") or {}),
                    "with_tensors": bool(kw.get("with_tensors"))}, sql=sql, rows=rows)
        except OSError as exc:
            raise StoreError(f"--out {out}: cannot write ({exc.strerror or str(exc).splitlines()[0]})") from None
        except ConfigError:
            raise
        except Exception as exc:  # DuckDB's errors (binder, conversion) as one line
            raise _failed(exc, uri, kw.get("with_tensors", False)) from None
    finally:
        with contextlib.suppress(OSError):  # e.g. a name the file system refuses: the error above says so
            tmp.unlink(missing_ok=True)
        con.close()
    return rows


def temp_path(out: str | Path, pid: int | None = None) -> Path:
    """Where :func:`write_query` of process ``pid`` (this one by default) writes ``out`` before renaming it
    into place: beside it, hidden, tagged with the pid. Within NAME_MAX (255 bytes, not characters: a
    name in a non-Latin script takes 3 or 4 a character) whatever out's length: at most its first 200
    bytes, never half a character (the writers take UTF-8)."""
    out = Path(out)
    head = os.fsencode(out.name)[:200].decode("utf-8", "ignore")
    return out.with_name(f".{head}.tmp{os.getpid() if pid is None else pid}")


def provenance_path(out: str | Path) -> Path:
    """Where ``featurestore query --out`` records how ``out`` was made: ``<out name>.provenance.json``
    beside it (the name's first 230 bytes, within NAME_MAX, never half a character)."""
    out = Path(out)
    head = os.fsencode(out.name)[:230].decode("utf-8", "ignore")
    return out.with_name(f"{head}.provenance.json")


def _write_provenance(out: Path, *, config: dict, inputs: dict, sql: str, rows: int) -> None:
    """``out``'s provenance (:func:`eaglenest.provenance.write_provenance`'s record) in :func:`provenance_path`."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".query-provenance-") as tmp:
        made = write_provenance(tmp, config=config, inputs=inputs,
                                extra={"query": sql, "outputs": {"file": out.name, "rows": rows}})
        os.replace(made, provenance_path(out))


def _remove_stale_temps(out: Path) -> None:
    """Remove the temporary files of earlier ``--out`` writes of ``out`` whose process is gone: a run
    killed by SIGKILL (or the OOM killer) cannot remove its own, and each would hold a partial copy
    of the result for good. A live process's file (a write in progress) is kept."""
    stem = temp_path(out, 0).name[:-1]
    for path in out.parent.glob(glob.escape(stem) + "*"):
        pid = path.name[len(stem):]
        if pid.isascii() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):  # removed by another rerun meanwhile, or not ours to remove
                path.unlink()
                log.info("removed %s, left by a killed `featurestore query --out` (pid %s)", path, pid)


def _check_csv_columns(schema: pa.Schema, out: Path) -> None:
    """Refuse, before anything is written, a result column a CSV file cannot hold: a list or struct
    (``input_ids``, ``loss_mask``) or bytes (the tensor columns). The CSV writer said only
    'Unsupported Type:list<l: int32>' or 'Invalid UTF8 payload', naming no column."""
    for field in schema:
        t = field.type
        if pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            raise ConfigError(f"--out {shown_path(str(out))}: column '{short_text(field.name, 80)}' is {t}, which a "
                              "CSV file cannot hold: write a .parquet file, or select scalar columns "
                              "(e.g. len(input_ids))")


@contextlib.contextmanager
def _writer(path: Path, suffix: str, schema: pa.Schema):
    """``write(batch)`` into a Parquet file (one row group per batch, flushed as it goes) or a CSV."""
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        # No min/max statistics nor dictionary for binary columns (tensors): pyarrow would keep a copy
        # of each row group's largest and smallest value in the footer, held in memory until close.
        small = [f.name for f in schema if not pa.types.is_binary(f.type) and not pa.types.is_large_binary(f.type)]
        w = pq.ParquetWriter(str(path), schema, write_statistics=small, use_dictionary=small)
    else:
        import pyarrow.csv as pcsv

        w = pcsv.CSVWriter(str(path), schema)
    try:
        yield w.write_batch
    finally:
        w.close()


def sql_name(name: str) -> str:
    """A table name as a quoted SQL identifier: a table may be named ``features-v2``, ``2024`` or
    ``order``, which SQL reads as an expression, a number or a keyword."""
    return '"' + name.replace('"', '""') + '"'


def loss_token_counts(uri: str, name: str, *, version: int | str | None, split: str, vocab_size: int):
    """int64 [vocab_size]: occurrences of each token id where loss_mask = 1, by a SQL aggregate over the
    rows the trainer reads (``split``, a loss token). Every input token of them is checked against the
    vocab, prompt positions included: the draft embeds each one, so an id outside it (features imported
    from another tokenizer with ``run.off_policy=true``) would crash training mid-run. The ids out of
    range fall into one group (at most ``vocab_size + 1`` groups whatever the table holds), which keeps
    the smallest and largest of them; only then is a sample holding one looked up."""
    import numpy as np

    rows = f"FROM {sql_name(name)} WHERE split = {store.sql_text(split)} AND num_loss_tokens > 0"
    sql = (f"SELECT CASE WHEN id >= 0 AND id < {int(vocab_size)} THEN id ELSE -1 END AS k, "
           "count(*) FILTER (WHERE m = 1) AS n, min(id) AS lo, max(id) AS hi "
           f"FROM (SELECT unnest(input_ids) AS id, unnest(loss_mask) AS m {rows}) GROUP BY k")
    t = run_query(uri, sql, versions={name: version})
    keys = t.column("k").to_numpy()
    if (keys < 0).any():
        out = int(np.nonzero(keys < 0)[0][0])
        lo, hi = t.column("lo")[out].as_py(), t.column("hi")[out].as_py()
        bad = lo if lo < 0 else hi
        found = run_query(uri, f"SELECT sample_id {rows} AND list_contains(input_ids, {int(bad)}) LIMIT 1",
                          versions={name: version})
        sample = short_text(found.column("sample_id")[0].as_py(), 80) if found.num_rows else "?"
        raise ConfigError(f"features table '{short_text(name, 80)}', sample '{sample}': token id {bad} is outside "
                          f"the target vocab [0, {vocab_size}): the features were captured with another target or "
                          "tokenizer (the draft embeds every input token)")
    counts = np.zeros(vocab_size, dtype=np.int64)
    counts[keys] = t.column("n").to_numpy()
    return counts
