from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.table import maintenance, store, versions
from eaglenest.featurestore.read import query
from eaglenest.featurestore import schema as S
from eaglenest.train import vocab as V

import fs_helpers as H  # on sys.path via conftest

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


@pytest.fixture
def three_versions(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{k}-{i}" for i in range(4)], m, domain=f"d{k % 2}", seed=k),
                     meta=m, lineage={"manifest_hash": f"m{k}"})
    return uri, m


def test_versions_tags_diff_checkout_restore(three_versions):
    uri, m = three_versions
    vs = versions.list_versions(uri, store.FEATURES)
    assert [v["version"] for v in vs] == [1, 2, 3, 4] and [v["rows"] for v in vs] == [0, 4, 8, 12]
    assert vs[2]["lineage"]["manifest_hash"] == "m1" and vs[2]["lineage"]["parent_version"] == 2
    assert versions.set_tag(uri, store.FEATURES, "good", 3) == 3
    d = versions.diff(uri, store.FEATURES, "good", 4)
    assert d["added"] == 4 and d["removed"] == 0 and d["per_domain"] == {"d0": 4}
    assert versions.summary(uri, store.FEATURES, "good")["rows"] == 8
    new = versions.restore(uri, store.FEATURES, "good")
    assert new == 5 and store.dataset(uri, store.FEATURES).count_rows() == 8
    assert store.read(uri, store.FEATURES, version=4).num_rows == 12  # history kept
    versions.delete_tag(uri, store.FEATURES, "good")
    with pytest.raises(StoreError, match="no tag 'good'"):
        versions.delete_tag(uri, store.FEATURES, "good")


def test_verify_names_a_corrupted_fragment(three_versions, capsys):
    uri, _ = three_versions
    assert maintenance.verify(uri, store.FEATURES)["ok"]
    ds = store.dataset(uri, store.FEATURES)
    frag = ds.get_fragments()[1]
    path = store.table_path(uri, store.FEATURES) / "data" / frag.data_files()[0].path
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # one flipped byte inside the tensor data
    path.write_bytes(bytes(raw))
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"]
    assert any(f"fragment {frag.fragment_id}" in p and "checksum" in p for p in report["problems"])
    # The recipe named, not found in the working directory (exit 2 for a missing recipe passed too).
    assert cli.main(["verify", "--recipe", RECIPE, f"run.workdir={uri}/..", f"run.store={uri}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"fragment {frag.fragment_id}: data file {path.name} fails its checksum" in err[0], err


def test_verify_finds_nan(tmp_path):
    uri, m = str(tmp_path), H.meta()
    rows = H.rows(["ok", "bad"], m)
    aux = np.zeros((rows[1]["num_tokens"], 3, 8), "float32")
    aux[1, 2, 3] = np.nan
    rows[1]["aux_hidden"] = S.encode_tensor(aux, "float32")
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"] and "NaN/inf in aux_hidden" in report["problems"][0] and "bad" in report["problems"][0]


def test_compact_and_gc_keep_tagged_versions(three_versions):
    uri, _ = three_versions
    versions.set_tag(uri, store.FEATURES, "keep", 2)
    c = maintenance.compact(uri, store.FEATURES)
    assert c["fragments_before"] == 3 and c["fragments_after"] == 1
    assert maintenance.verify(uri, store.FEATURES)["ok"]
    g = maintenance.gc(uri, store.FEATURES, older_than_hours=0)
    assert 2 in g["versions_after"] and c["version"] in g["versions_after"] and 3 not in g["versions_after"]
    assert store.read(uri, store.FEATURES, version="keep").num_rows == 4
    assert store.dataset(uri, store.FEATURES).count_rows() == 12
    assert maintenance.verify(uri, store.FEATURES)["ok"] and maintenance.verify(uri, store.FEATURES, version="keep")["ok"]


def test_query_read_only_and_examples(three_versions, tmp_path):
    uri, _ = three_versions
    t = query.run_query(uri, "SELECT domain, count(*) AS n, sum(num_tokens) AS toks FROM features "
                             "GROUP BY domain ORDER BY domain")
    assert t.column("domain").to_pylist() == ["d0", "d1"] and t.column("n").to_pylist() == [8, 4]
    with pytest.raises(StoreError, match="aux_hidden"):
        query.run_query(uri, "SELECT aux_hidden FROM features")
    assert query.run_query(uri, "SELECT octet_length(aux_hidden) AS b FROM features", with_tensors=True).num_rows == 12
    evals = tmp_path / "eval.csv"
    evals.write_text("sample_id,al\ns0-0,2.5\ns1-1,1.5\n")
    j = query.run_query(uri, "SELECT f.domain, avg(e.al) AS al FROM features f JOIN ev e USING (sample_id) "
                             "GROUP BY 1 ORDER BY 1", attach={"ev": str(evals)})
    assert j.column("al").to_pylist() == [2.5, 1.5]
    for bad in ("DELETE FROM features", "SELECT 1; DROP TABLE features", "COPY features TO 'x.csv'",
                "ATTACH 'x.db'", "CREATE TABLE x AS SELECT 1"):
        with pytest.raises(ConfigError, match="query:"):
            query.run_query(uri, bad)
    with pytest.raises(StoreError, match="disabled"):
        query.run_query(uri, f"SELECT * FROM read_csv_auto('{evals}')")


def test_vocab_counts_by_query_equal_python(three_versions):
    uri, _ = three_versions
    by_sql = V.count_loss_tokens_in_store(uri, version=3, split="train", vocab_size=64)
    ref = V.count_loss_tokens(store.read(uri, store.FEATURES, version=3).to_batches(), 64)
    assert by_sql.sum() > 0 and np.array_equal(by_sql, ref)
