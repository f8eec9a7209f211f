"""Third QA pass over the sample reader: hostile destinations, layer orders and indices."""

import dataclasses

import pyarrow as pa
import pytest

import fs_helpers as H
from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.read.sample import Into
from eaglenest.featurestore.table import store


def _store(tmp_path, storage="raw"):
    """Rows 'a' (1 token), 'b' (2), 'c' (3): samples of length 1 included."""
    m = dataclasses.replace(H.meta(), storage=storage)
    uri, rows = str(tmp_path / "store"), H.rows(["a", "b", "c"], m, num_tokens=1)
    for r in rows:  # H.rows encodes raw float32; the storage's own encoding of the same values
        T = r["num_tokens"]
        for col, shape in (("aux_hidden", (T, 3, m.hidden_size)), ("last_hidden", (T, m.hidden_size))):
            r[col] = S.encode_value(S.decode_tensor(r[col], shape, "float32").copy(), m)
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    return uri, m


@pytest.mark.parametrize("storage", ["raw", "fp8_e4m3"])
def test_a_destination_longer_than_the_sample_is_refused_on_the_converting_copy(tmp_path, storage):
    """A destination of 3 tokens for a 1-token sample, in another dtype than the stored one: the
    converting copy broadcast the one token into all three rows, silently (the read straight into
    a destination in the stored dtype refused it)."""
    import torch

    uri, m = _store(tmp_path, storage)
    dest = Into(aux=torch.full((3, 3, m.hidden_size), -7.0, dtype=torch.float64),
                last=torch.full((3, m.hidden_size), -7.0, dtype=torch.float64))
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        assert r.take(0).num_tokens == 1
        with pytest.raises(SchemaError, match=r"^row 0: destination \(3, 3, 8\) for aux_hidden does not fit "
                                              r"a sample of 1 tokens"):
            r.read([0], into=[dest])
        fits = Into(aux=dest.aux[:1], last=dest.last[:1])  # the one token it has: read, the rest untouched
        (s,) = r.read([0], into=[fits])
    assert s.num_tokens == 1
    assert torch.all(dest.aux[1:] == -7.0) and torch.all(dest.last[1:] == -7.0)
    assert not torch.all(dest.aux[0] == -7.0)


def test_a_destination_of_another_width_is_refused_by_row(tmp_path):
    """A destination of hidden size 4 for a table of hidden size 8: a torch RuntimeError about
    tensor sizes, naming neither the row nor the column."""
    import torch

    uri, m = _store(tmp_path)
    dest = Into(aux=torch.empty(2, 3, 4, dtype=torch.float64), last=torch.empty(2, 4, dtype=torch.float64))
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        with pytest.raises(SchemaError, match=r"^row 1: destination \(2, 3, 4\) for aux_hidden .*\[n <= 2, 3, 8\]"):
            r.read([1], into=[dest])


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("order, bad", [([-1, 0, 1], -1), ([0, 1, 3], 3)])
def test_a_layer_order_outside_the_tables_layers_is_refused(tmp_path, dtype_name, order, bad):
    """An aux layer order naming position -1 silently took the table's last aux layer (Python's
    indexing from the end) when the destination's dtype differed from the stored one, and was a
    torch ``INDICES element is out of DATA bounds`` otherwise; position 3 of a 3-layer table the same
    RuntimeError."""
    import torch

    uri, m = _store(tmp_path)
    dtype = getattr(torch, dtype_name)
    dest = Into(aux=torch.empty(2, 3, m.hidden_size, dtype=dtype), last=torch.empty(2, m.hidden_size, dtype=dtype),
                order=order)
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        with pytest.raises(SchemaError, match=rf"^row 1: layer order \[.*\] names position {bad}, outside the "
                                              r"table's 3 aux layers \(0\.\.2\)"):
            r.read([1], into=[dest])


@pytest.mark.parametrize("name, decoy", [("res[1]", "res1"), ("x*y", "xAy"), ("r?", "rr")])
@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl", ".json"])
def test_an_attached_file_whose_name_holds_glob_characters_is_read_itself(tmp_path, name, decoy, suffix):
    """``--attach ev=res[1].parquet``: DuckDB took the path for a glob pattern and read ``res1.parquet``
    (``x*y``: every file it matched), silently."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from eaglenest.featurestore.read import query

    uri, _ = _store(tmp_path)
    files = tmp_path / "files"
    files.mkdir()
    for stem, score in ((name, 1), (decoy, 9)):
        t = pa.table({"sample_id": ["a"], "score": [score]})
        path = files / f"{stem}{suffix}"
        if suffix == ".parquet":
            pq.write_table(t, path)
        elif suffix == ".csv":
            pcsv.write_csv(t, path)
        else:
            lines = [f'{{"sample_id": "a", "score": {score}}}']
            path.write_text("\n".join(lines) + "\n" if suffix == ".jsonl" else f"[{lines[0]}]")
    got = query.run_query(uri, "SELECT f.sample_id, e.score FROM features f JOIN ev e USING (sample_id)",
                          attach={"ev": str(files / f"{name}{suffix}")})
    assert got.to_pylist() == [{"sample_id": "a", "score": 1}]


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_query_out_of_a_long_non_latin_name_is_written(tmp_path, suffix):
    """``--out`` of 82 CJK characters (246 bytes plus the suffix: a valid name) was refused with
    'File name too long': its temporary name kept 200 *characters* of it, over 255 bytes."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    from eaglenest.featurestore.read import query

    uri, _ = _store(tmp_path)
    out = tmp_path / ("結" * ((255 - len(suffix)) // 3) + suffix)  # as long as a name may be
    assert 250 <= len(out.name.encode()) <= 255
    assert query.write_query(uri, "SELECT sample_id FROM features ORDER BY 1", out) == 3
    back = pq.read_table(out) if suffix == ".parquet" else pcsv.read_csv(out)
    assert back.column("sample_id").to_pylist() == ["a", "b", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["store", out.name])  # no temporary file left


@pytest.mark.parametrize("name", ["feat-v2", "2024", "order"])
def test_loss_token_counts_of_a_table_whose_name_sql_would_misread(tmp_path, name):
    """``featurestore.table=feat-v2`` (a valid table name): the draft vocabulary's token counts, a SQL
    aggregate over the table, failed to parse (``FROM feat-v2`` is a subtraction; ``2024`` a number,
    ``order`` a keyword), so ``train run`` stopped with 'query: cannot parse SQL'."""
    import numpy as np

    from eaglenest.featurestore.read import query

    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, name, H.table(["a", "b", "c"], m), meta=m)
    want = np.zeros(64, np.int64)
    for r in H.rows(["a", "b", "c"], m):
        for t, keep in zip(r["input_ids"], r["loss_mask"], strict=True):
            want[t] += keep
    got = query.loss_token_counts(uri, name, version=None, split="train", vocab_size=64)
    assert want.sum() > 0 and np.array_equal(got, want)


@pytest.mark.parametrize("sql, column, kind", [
    ("SELECT * FROM features", "input_ids", "list<"),
    ("SELECT sample_id, last_hidden FROM features", "last_hidden", "binary"),
])
def test_query_out_csv_of_a_column_csv_cannot_hold_names_the_column(tmp_path, capsys, sql, column, kind):
    """``featurestore query --sql "SELECT * FROM features" --out f.csv``: 'query failed: Unsupported
    Type:list<l: int32>' (the tensor columns: 'Invalid UTF8 payload'), naming no column and no way out."""
    from pathlib import Path

    from eaglenest.featurestore import cli

    uri, _ = _store(tmp_path)
    out = tmp_path / "f.csv"
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
    code = cli.main(["query", "--sql", sql, "--with-tensors", "--out", str(out), "--recipe", recipe,
                     f"run.store={uri}", f"run.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"column '{column}' is {kind}" in err[0] and "write a .parquet file" in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".f.csv*"))
    assert cli.main(["query", "--sql", sql, "--with-tensors", "--out", str(tmp_path / "f.parquet"), "--recipe",
                     recipe, f"run.store={uri}", f"run.workdir={tmp_path}"]) == 0
