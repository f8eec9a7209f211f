"""``featurestore query --out FILE``: the result's provenance beside it (qa9).

Every output of eaglenest has a record of what made it (code version, argv, resolved recipe, package
versions, input table versions); a query result had none. It is ``<name>.provenance.json`` beside the
file, naming the version of each table the statement read (the pinned one under ``--version``).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import pyarrow.parquet as pq

from eaglenest.errors import StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import store

import fs_helpers as H  # on sys.path via conftest


def _store(tmp_path) -> str:
    uri, m = str(tmp_path / "store"), H.meta()
    assert store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m) == 2  # v1: the empty table
    assert store.append(uri, store.FEATURES, H.table(["c"], m, seed=1), meta=m) == 3
    assert store.append(uri, store.PROMPTS, pa.Table.from_pylist(H.prompt_rows(2), schema=S.PROMPTS_SCHEMA)) == 2
    return uri


def test_query_out_writes_its_provenance_beside_the_file(tmp_path):
    uri = _store(tmp_path)
    out = tmp_path / "out dir" / "res [1].parquet"
    out.parent.mkdir()
    recipe = {"run": {"store": uri}}
    sql = "SELECT sample_id FROM features ORDER BY 1"
    assert query.write_query(uri, sql, out, config=recipe, versions={"features": 2}) == 2
    assert pq.read_table(out).column("sample_id").to_pylist() == ["a", "b"]
    prov = json.loads(query.provenance_path(out).read_text())
    assert query.provenance_path(out) == out.parent / "res [1].parquet.provenance.json"
    assert prov["config"] == recipe and prov["query"] == sql
    assert prov["inputs"]["store"] == uri and prov["inputs"]["tables"] == {"features": 2}  # the pinned version
    assert prov["outputs"] == {"file": out.name, "rows": 2}
    assert {"code_version", "argv", "packages"} <= set(prov)
    # The latest version when nothing is pinned; only the tables the statement reads.
    out2 = out.parent / "n.csv"
    assert query.write_query(uri, "SELECT count(*) AS n FROM prompts", out2, config=recipe) == 1
    assert json.loads(query.provenance_path(out2).read_text())["inputs"]["tables"] == {"prompts": 2}
    assert query.write_query(uri, "SELECT count(*) AS n FROM features", out2, config=recipe) == 1
    assert json.loads(query.provenance_path(out2).read_text())["inputs"]["tables"] == {"features": 3}
    # Each result its own record; no temporary file or folder left.
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        [out.name, query.provenance_path(out).name, out2.name, query.provenance_path(out2).name])


def test_a_failed_query_writes_no_provenance(tmp_path):
    uri = _store(tmp_path)
    out = tmp_path / "r.parquet"
    with pytest.raises(StoreError, match=r"^query failed: .*no_such_column"):
        query.write_query(uri, "SELECT no_such_column FROM features", out, config={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_the_provenance_of_a_name_as_long_as_allowed_is_written(tmp_path):
    uri = _store(tmp_path)
    out = tmp_path / ("結" * 82 + ".parquet")  # 254 bytes: a valid name, no room for a suffix
    assert query.write_query(uri, "SELECT sample_id FROM features", out, config={}) == 3
    prov = query.provenance_path(out)
    assert len(prov.name.encode()) <= 255 and prov.name.endswith(".provenance.json")
    assert json.loads(prov.read_text())["outputs"]["file"] == out.name


def test_cli_query_out_writes_provenance(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    store.append(uri, store.FEATURES, H.table(["c"], m, seed=1), meta=m)
    out = tmp_path / "q.csv"
    assert cli.main(["query", "--sql", "SELECT sample_id FROM features", "--version", "2", "--out", str(out),
                     f"run.store={uri}"]) == 0
    prov = json.loads(query.provenance_path(out).read_text())
    assert prov["inputs"]["tables"] == {"features": 2} and prov["config"]["run"]["store"] == uri
