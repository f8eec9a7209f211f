"""``featurestore query --out``: results streamed into the file batch by batch, in bounded memory.

A query with tensor columns used to materialise every table and the whole result before writing
(peak memory ~3x the table); now tensor tables are scanned batch by batch and the result is
written as it comes (``featurestore/read/query.py``). The memory test runs the command in a fresh
process on a table sixteen batches large and bounds that process's peak RSS growth below the
table's size; ``bench/featurestore_query_memory.py`` shows the same at two table sizes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import store

import fs_helpers as H  # on sys.path via conftest


@pytest.fixture
def small(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table([f"s{i}" for i in range(6)], m, domain="a"), meta=m)
    store.append(uri, store.FEATURES, H.table([f"t{i}" for i in range(5)], m, domain="b", seed=1), meta=m)
    return uri


def test_out_parquet_holds_the_tensors_bit_exactly(small, tmp_path, monkeypatch):
    monkeypatch.setattr(query, "BATCH_BYTES", 1)  # one row per batch: many batches, many row groups
    out = tmp_path / "q.parquet"
    sql = "SELECT sample_id, domain, aux_hidden, last_hidden FROM features WHERE domain = 'b' ORDER BY sample_id"
    assert query.write_query(small, sql, out, with_tensors=True) == 5
    got = pq.read_table(out)
    want = store.read(small, store.FEATURES, filter="domain = 'b'",
                      columns=["sample_id", "domain", "aux_hidden", "last_hidden"]).sort_by("sample_id")
    assert got.column("sample_id").to_pylist() == want.column("sample_id").to_pylist()
    for col in ("aux_hidden", "last_hidden"):
        assert [bytes(v) for v in got.column(col).to_pylist()] == [bytes(v) for v in want.column(col).to_pylist()]
    # A self-join scans the tensor table twice (each scan a fresh pass); a CSV streams too.
    sql = "SELECT a.sample_id, octet_length(b.aux_hidden) AS n FROM features a JOIN features b USING (sample_id)"
    assert query.write_query(small, sql, tmp_path / "j.csv", with_tensors=True) == 11
    assert len((tmp_path / "j.csv").read_text().splitlines()) == 12
    # A filter DuckDB pushes down on a tensor column the projection leaves out.
    sql = "SELECT sample_id FROM features WHERE aux_hidden IS NOT NULL AND domain = 'a'"
    assert query.write_query(small, sql, tmp_path / "f.parquet", with_tensors=True) == 6
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left beside the outputs


def test_refused_or_failed_query_writes_nothing(small, tmp_path):
    out = tmp_path / "x.parquet"
    with pytest.raises(ConfigError, match="only SELECT"):
        query.write_query(small, "DELETE FROM features", out)
    with pytest.raises(StoreError, match="query failed"):
        query.write_query(small, "SELECT no_such_column FROM features", out, with_tensors=True)
    with pytest.raises(ConfigError, match="use a .csv or .parquet"):
        query.write_query(small, "SELECT 1", tmp_path / "x.json")
    with pytest.raises(ConfigError, match="does not exist"):
        query.write_query(small, "SELECT 1", tmp_path / "nowhere" / "x.parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert cli.main(["query", "--sql", "SELECT sample_id FROM features", "--out", str(out), f"run.store={small}"]) == 0
    assert pq.read_table(out).num_rows == 11


def test_query_out_name_as_long_as_allowed_is_written(small, tmp_path):
    """``.NAME.tmpPID`` beside a 250-character NAME passed the 255-byte limit: the write failed, then the
    cleanup's unlink raised again, a traceback hiding the one-line error."""
    uri = small
    out = tmp_path / ("a" * 242 + ".parquet")  # 250 characters
    assert query.write_query(uri, "SELECT sample_id FROM features", out) == 11
    assert pq.read_table(out).num_rows == 11
    with pytest.raises(StoreError, match=r"--out .*: cannot write \(File name too long\)") as info:
        query.write_query(uri, "SELECT sample_id FROM features", tmp_path / ("b" * 292 + ".parquet"))
    assert "\n" not in str(info.value)
    with pytest.raises(StoreError, match="cannot write"):  # --out an existing folder: the rename fails
        (tmp_path / "d.csv").mkdir()
        query.write_query(uri, "SELECT sample_id FROM features", tmp_path / "d.csv")
    assert not list(tmp_path.glob(".*tmp*"))


CHILD = H.PEAK_CHILD


def test_query_out_with_tensors_peak_memory_is_bounded_by_the_batch(small, tmp_path):
    """256 MiB of tensors, 8 MiB batches (query.BATCH_BYTES): the command's peak RSS growth stays
    far below the table's size (measured 50-120 MiB here whatever the table's size: Lance's I/O
    buffer, a few batches in flight); the old code, which materialised the table and the result,
    grew ~2.3x the table (~290 MiB for 128 MiB). The bound is the table's size less 96 MiB: a
    margin for the noise of a loaded machine (CI once measured 102 MiB against a bound of 100)
    that still fails the old code by far."""
    big = str(tmp_path / "big")
    H.big_table(big, rows=64, row_mib=4)
    out = tmp_path / "big.parquet"
    proc = subprocess.run([sys.executable, "-c", CHILD, small, big, str(out)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"]
    assert pq.read_metadata(out).num_rows == 64
    assert growth < 160, f"peak RSS grew {growth:.0f} MiB for a 256 MiB table"


def test_named_tables_come_from_the_parse_tree_without_binding():
    assert query.named_tables("WITH x AS (SELECT * FROM Features) SELECT * FROM x, \"Other\" o "
                              "WHERE 1 IN (SELECT 1 FROM prompts)") == {"features", "x", "other", "prompts"}
    # a table function is not a table, and is not run (the file does not exist)
    assert query.named_tables("SELECT (SELECT count(*) FROM main.features) UNION ALL "
                              "SELECT 1 FROM read_parquet('nowhere.parquet')") == {"features"}
    assert query.named_tables("SELECT * FRM x") is None


def test_a_query_registers_only_the_tables_it_names(small, tmp_path):
    """A damaged table the statement does not name is neither checked nor read; one it names is refused."""
    uri = small
    m = H.meta()
    store.append(uri, "other", H.table(["o0", "o1"], m, domain="c"), meta=m)
    data = sorted((store.table_path(uri, "other") / "data").glob("*.lance"))
    data[0].write_bytes(b"damaged")
    assert query.run_query(uri, "SELECT count(*) AS n FROM features").column("n").to_pylist() == [11]
    out = tmp_path / "ids.csv"
    assert query.write_query(uri, "SELECT sample_id FROM features", out) == 11
    with pytest.raises(StoreError, match="other"):
        query.run_query(uri, "SELECT count(*) FROM other")
    with pytest.raises(StoreError, match="other"):  # named inside a subquery
        query.run_query(uri, "SELECT count(*) FROM features WHERE sample_id IN (SELECT sample_id FROM OTHER)")


def _small_columns_table(uri: str, monkeypatch, *, mib: int, tokens: int = 16384) -> int:
    """A features table with ``mib`` MiB of token ids and masks (tensors of one token, hidden 8).
    Rows whose tensors are far shorter than their tokens are refused by the write
    (``schema.row_problem``): the check is off here, the query reads no tensor."""
    import numpy as np
    import pyarrow as pa

    from eaglenest.featurestore import schema as S

    m = H.meta()
    n = mib * 2**20 // (5 * tokens)
    rng = np.random.default_rng(0)
    aux = S.encode_value(np.zeros((1, 3, m.hidden_size), np.float32), m)
    last = S.encode_value(np.zeros((1, m.hidden_size), np.float32), m)
    for start in range(0, n, 128):
        rows = [{"sample_id": f"s{k:05d}", "domain": f"d{k % 3}", "source": "t", "split": "train", "mode": "chat",
                 "gen_params_id": "g", "num_tokens": 1, "num_loss_tokens": 1,
                 "input_ids": rng.integers(0, 1 << 17, tokens, dtype=np.int32), "loss_mask": np.ones(tokens, np.uint8),
                 "aux_hidden": aux, "last_hidden": last} for k in range(start, min(n, start + 128))]
        with monkeypatch.context() as patch:
            patch.setattr(S, "row_problem", lambda table, meta: None)
            store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    return n


CHILD_SMALL = CHILD.replace('"--with-tensors", ', "").replace(
    '"SELECT * FROM features", "--out"]', '"SELECT domain, sum(len(input_ids)) AS t FROM features GROUP BY 1"]'
).replace("q + [out, ", "q + [")


def test_a_query_over_the_small_columns_is_scanned_not_materialised(small, tmp_path, monkeypatch):
    """An aggregate over every token id of a 320 MiB table (no tensors asked for): the table is scanned
    batch by batch, so the command's peak RSS grows far less than the table (50-90 MiB measured here at
    160 or 320 MiB; the old registration materialised every small column: growth ~1.1x the table's
    size, 1138 MiB for 1 GiB in the bench). The bound, half the table, leaves room for a loaded
    machine's noise (CI once measured 102 MiB against the old bound of 100 for 160 MiB)."""
    big = str(tmp_path / "big")
    n = _small_columns_table(big, monkeypatch, mib=320)
    assert "--with-tensors" not in CHILD_SMALL and "--out" not in CHILD_SMALL
    proc = subprocess.run([sys.executable, "-c", CHILD_SMALL, small, big, ""], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{n // 3 * 16384}" in proc.stdout or f"{(n // 3 + 1) * 16384}" in proc.stdout  # the sums printed
    growth = json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"]
    assert growth < 160, f"peak RSS grew {growth:.0f} MiB for a table with 320 MiB of small columns"
