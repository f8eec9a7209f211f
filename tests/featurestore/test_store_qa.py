"""QA pass on the store core: rows whose sizes disagree, ``verify``'s memory, reader indices.

* A features row is sized by ``num_tokens``: ``input_ids``, ``loss_mask`` and the tensor values must
  agree with it (and with the table's layers, hidden size, dtype and storage). A row that does not
  was stored, passed ``verify`` and failed only when training read it; now the write refuses it,
  naming the row and the column, and ``verify`` reports one already stored.
* ``verify`` decoded each fragment whole: after ``compact`` (one fragment for the whole table) its
  memory grew with the table. It now scans a fragment batch by batch.
* The sample reader reported a row index past the end as a fragment that fails to read (pointing
  at ``verify``) and a negative one as a numpy overflow; ``group=0`` silently read nothing.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import fs_helpers as H

from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import query
from eaglenest.featurestore.read.reader import SampleReader
from eaglenest.featurestore.read.sample import Into
from eaglenest.featurestore.table import maintenance, store, versions

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def _short(value: bytes) -> bytes:
    return value[:-4]


def _long(value: bytes) -> bytes:
    return value + b"\0" * 4


@pytest.mark.parametrize("storage", ["raw", "fp8_e4m3"])
@pytest.mark.parametrize("col, change, says", [
    ("aux_hidden", _short, "aux_hidden holds"),
    ("last_hidden", _long, "last_hidden holds"),
    ("input_ids", lambda v: v[:-1], "input_ids holds"),
    ("loss_mask", lambda v: v + [1], "loss_mask holds"),
])
def test_a_row_whose_sizes_disagree_is_refused_naming_it(tmp_path, storage, col, change, says):
    uri, m = str(tmp_path / "store"), H.meta()
    m = dataclasses.replace(m, storage=storage)
    good = H.rows(["a", "b"], H.meta())
    if storage == "fp8_e4m3":  # values re-encoded in the table's storage
        for r in good:
            aux = S.decode_tensor(r["aux_hidden"], (r["num_tokens"], 3, 8), "float32")
            last = S.decode_tensor(r["last_hidden"], (r["num_tokens"], 8), "float32")
            r["aux_hidden"], r["last_hidden"] = S.encode_value(aux, m), S.encode_value(last, m)
    store.append(uri, store.FEATURES, pa.Table.from_pylist(good, schema=S.features_schema(m)), meta=m)
    before = store.latest_version(uri, store.FEATURES)
    bad = H.rows(["c", "d-bad"], H.meta(), seed=1)
    bad[0]["aux_hidden"], bad[0]["last_hidden"] = good[0]["aux_hidden"], good[0]["last_hidden"]
    bad[1]["aux_hidden"], bad[1]["last_hidden"] = good[1]["aux_hidden"], good[1]["last_hidden"]
    bad[1][col] = change(bad[1][col])
    with pytest.raises(SchemaError, match=rf"row 'd-bad': {says} .*num_tokens 5.*nothing was written"):
        store.append(uri, store.FEATURES, pa.Table.from_pylist(bad, schema=S.features_schema(m)), meta=m)
    assert store.latest_version(uri, store.FEATURES) == before
    assert store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist() == ["a", "b"]


def test_rows_without_tokens_are_stored_and_read(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    rows = H.rows(["a", "empty"], m)
    rows[1].update(num_tokens=0, num_loss_tokens=0, input_ids=[], loss_mask=[], aux_hidden=b"", last_hidden=b"")
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    assert maintenance.verify(uri, store.FEATURES)["ok"]
    with SampleReader(store.dataset(uri, store.FEATURES)) as reader:
        got = reader.read([1, 0])
    assert [tuple(s.aux_stored().shape) for s in got] == [(0, 3, 8), (4, 3, 8)]


def test_verify_reports_a_stored_row_whose_sizes_disagree(tmp_path, monkeypatch):
    """A row stored by a writer that did not check (an older eaglenest): ``verify`` names it."""
    uri, m = str(tmp_path / "store"), H.meta()
    rows = H.rows(["a", "b-short"], m)
    rows[1]["aux_hidden"] = rows[1]["aux_hidden"][:-32]
    with monkeypatch.context() as patch:
        patch.setattr(S, "row_problem", lambda table, meta: None)
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"] and len(report["problems"]) == 1, report
    assert report["problems"][0].startswith("fragment 0: row 'b-short': aux_hidden holds 448 bytes, not the 480")
    with pytest.raises(StoreError, match="row 'b-short': aux_hidden"):
        maintenance.require_ok(report)


#: The child: peak anonymous memory growth of one ``verify`` of a table after a warm-up one.
CHILD = r"""
import json, sys, threading, time
from eaglenest.featurestore.table import maintenance

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

uri = sys.argv[1]
maintenance.verify(uri, "features")
peak = [0]

def sample():
    while True:
        peak[0] = max(peak[0], anon_kib())
        time.sleep(0.002)

threading.Thread(target=sample, daemon=True).start()
time.sleep(0.01)
before = peak[0] = anon_kib()
report = maintenance.verify(uri, "features")
time.sleep(0.01)
print(json.dumps({"ok": report["ok"], "fragments": report["fragments"], "growth_mib": (peak[0] - before) / 1024}))
"""


def test_verify_of_a_compacted_table_holds_a_batch_not_the_fragment(tmp_path):
    """192 MiB of tensors compacted into one fragment: ``verify`` grew ~370 MiB when it decoded the
    fragment whole, ~35 MiB batch by batch."""
    uri = str(tmp_path / "store")
    H.big_table(uri, rows=48, row_mib=4)
    assert maintenance.compact(uri, store.FEATURES)["fragments_after"] == 1
    proc = subprocess.run([sys.executable, "-c", CHILD, uri], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["fragments"] == 1, out
    assert out["growth_mib"] < 96, out


@pytest.fixture()
def reader(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    for c in range(2):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(3)], m, seed=c), meta=m)
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        yield r


@pytest.mark.parametrize("index", [6, 7, 2**40, -1])
def test_a_row_index_outside_the_version_is_named(reader, index):
    with pytest.raises(StoreError, match=rf"row {index} is out of range \(the version has 6 rows: 0\.\.5\)"):
        reader.read([0, index])
    with pytest.raises(StoreError, match=rf"row {index} is out of range"):
        reader.take(index)
    assert [s.num_tokens for s in reader.read([5, 0])] == [6, 4]  # the reader still reads


def test_a_group_of_zero_is_refused_not_an_empty_read(reader):
    with pytest.raises(ValueError, match="group must be >= 1, not 0"):
        list(reader.iter_samples(range(6), group=0))
    assert len(list(reader.iter_samples(range(6), group=1))) == 6


def test_show_lists_every_feature_sets_table(tmp_path, capsys):
    """One table per feature set (featurestore.table): ``show`` listed only ``prompts`` and ``features``."""
    uri, m, other = str(tmp_path / "store"), H.meta(), H.meta(layer_ids=(1, 2, 3))
    store.append(uri, store.FEATURES, H.table(["a", "b", "c"], m), meta=m)
    store.append(uri, "feats2", H.table(["x", "y"], other), meta=other)
    for table in ("features", "feats2"):
        assert cli.main(["show", "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={tmp_path}",
                         f"featurestore.table={table}"]) == 0
        tables = json.loads(capsys.readouterr().out)["tables"]
        assert sorted(tables) == ["feats2", "features"], tables
        assert (tables["features"]["rows"], tables["feats2"]["rows"]) == (3, 2)
        layers = (tables["features"]["meta"]["layer_ids"], tables["feats2"]["meta"]["layer_ids"])
        assert layers == ([2, 4, 5], [1, 2, 3])


def test_query_version_of_a_table_the_store_lacks_is_refused(tmp_path, capsys):
    """``--version`` pins featurestore.table: in a store without that table the pin was dropped
    silently and the query read the latest version of the tables it named."""
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, "feats2", H.table(["x", "y"], m), meta=m)
    code = cli.main(["query", "--sql", "SELECT count(*) AS n FROM feats2", "--version", "1", "--recipe", RECIPE,
                     f"run.store={uri}", f"run.workdir={tmp_path}"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in captured.err, captured.err
    assert "pinned for table 'features', which the store" in err[0] and "(tables: feats2;" in err[0], err
    assert captured.out == ""


@pytest.mark.parametrize("tensors", [False, True])
def test_query_printout_keeps_only_the_rows_it_shows_and_shows_the_same(tmp_path, monkeypatch, tensors):
    """``featurestore query`` without ``--out`` prints at most ``--max-rows`` rows (pandas: the first
    and last halves): the preview keeps those rows, read batch by batch, and prints what the whole
    result printed, for results shorter and longer than the printout, batch boundaries anywhere."""
    uri, m = str(tmp_path / "store"), H.meta()
    for c in range(3):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(3)], m, seed=c), meta=m)
    monkeypatch.setattr(query, "BATCH_BYTES", 1)  # with tensors: one row per batch
    sql = "SELECT sample_id, num_tokens" + (", aux_hidden" if tensors else "") + " FROM features ORDER BY sample_id"
    whole = query.run_query(uri, sql, with_tensors=tensors).to_pandas()
    for max_rows in (1, 2, 3, 4, 5, 8, 9, 10, 50):
        kept = query.preview_query(uri, sql, max_rows=max_rows, with_tensors=tensors)
        assert kept.num_rows == min(9, 2 * (max_rows // 2 + 1)), max_rows
        assert kept.to_pandas().to_string(index=False, max_rows=max_rows) == \
            whole.to_string(index=False, max_rows=max_rows), max_rows


#: The child: peak RSS growth of one printed ``featurestore query --with-tensors`` after a warm-up.
PRINT_CHILD = r"""
import contextlib, io, json, sys
from eaglenest.featurestore import cli

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

warm, big = sys.argv[1:3]
q = ["query", "--with-tensors", "--sql", "SELECT * FROM features", "--max-rows", "4"]
with contextlib.redirect_stdout(io.StringIO()):
    assert cli.main(q + [f"run.store={warm}"]) == 0  # libraries loaded, runtimes started
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS (Linux)
before = kib("VmRSS:")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert cli.main(q + [f"run.store={big}"]) == 0
print(json.dumps({"growth_mib": (kib("VmHWM:") - before) / 1024, "lines": len(out.getvalue().splitlines())}))
"""


def test_a_printed_query_with_tensors_does_not_hold_the_table(tmp_path):
    """2048 rows, ~160 MiB of tensors, printed 4 rows: ~105 MiB growth (DuckDB and Lance buffers);
    ~380 MiB when the whole result was fetched to print 4 rows of it. The bound, 200 MiB, leaves a
    loaded machine's noise room (+-30 MiB seen) and still fails the old fetch by far."""
    warm, big = str(tmp_path / "warm"), str(tmp_path / "big")
    m = H.meta(hidden=1024)
    store.append(warm, store.FEATURES, H.table(["w"], m), meta=m)
    for c in range(8):
        store.append(big, store.FEATURES, H.table([f"c{c}r{i}" for i in range(256)], m, seed=c), meta=m)
    proc = subprocess.run([sys.executable, "-c", PRINT_CHILD, warm, big], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lines"] == 6, out  # the header, 2 rows, '...', 2 rows
    assert out["growth_mib"] < 200, out


# -- second pass ---------------------------------------------------------------------------------


def _features_with_meta(uri: str, text: bytes) -> None:
    """A features table whose ``eaglenest.feature_meta`` is ``text`` (a table another tool wrote)."""
    import lance

    m = H.meta()
    t = H.table(["a", "b"], m)
    t = t.replace_schema_metadata({**t.schema.metadata, b"eaglenest.feature_meta": text})
    lance.write_dataset(t, str(Path(uri) / "features.lance"), data_storage_version="2.0")


def _meta_json(**change) -> bytes:
    d = json.loads(H.meta().to_json())
    d.update(change)
    return json.dumps({k: v for k, v in d.items() if v is not ...}).encode()


@pytest.mark.parametrize("text, says", [
    (b"{not json", "is not JSON"),
    (b"[1, 2]", "is [1, 2], not a JSON object"),
    (_meta_json(layer_ids=...), "lacks key 'layer_ids'"),
    (_meta_json(hidden_size="8"), "key 'hidden_size' is '8', expected int"),
    (_meta_json(layer_ids=[2, "4"]), "key 'layer_ids' is [2, '4'], expected a list of ints"),
    (_meta_json(dtype="float64"), "key 'dtype' is 'float64'"),
    (_meta_json(storage="zstd"), "key 'storage' is 'zstd'"),
    (_meta_json(hidden_size=0), "key 'hidden_size' is 0"),
])
def test_a_features_table_whose_meta_is_damaged_is_one_line(tmp_path, capsys, text, says):
    """``show`` and ``verify`` printed a JSONDecodeError, KeyError or TypeError traceback, and a meta of
    the wrong kinds passed ``show`` and failed later inside numpy; the reader met the same."""
    uri = str(tmp_path / "store")
    _features_with_meta(uri, text)
    for verb in ("show", "verify"):
        code = cli.main([verb, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={tmp_path}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "eaglenest.feature_meta" in err[0] and says in err[0], (verb, err)
    report = maintenance.verify(uri, store.FEATURES)  # a finding in the report, as a damaged schema is
    assert not report["ok"] and says in report["problems"][0], report
    with pytest.raises(SchemaError, match="eaglenest.feature_meta") as exc:
        SampleReader(store.dataset(uri, store.FEATURES), integrity="off")
    assert says in str(exc.value)


@pytest.fixture()
def three_versions(tmp_path) -> str:
    uri, m = str(tmp_path / "store"), H.meta()
    for c in range(3):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(3)], m, seed=c), meta=m)
    return uri


@pytest.mark.parametrize("argv, says", [
    (["tags", "--create", ""], "bad tag name ''"),
    (["tags", "--delete", ""], "bad tag name ''"),
    (["tags", "--create", "", "--delete", "keep"], "--create and --delete are one at a time"),
    (["query", "--version", "", "--sql", "SELECT count(*) AS n FROM features"], "has no tag ''"),
])
def test_an_empty_option_value_is_refused_not_taken_for_no_option(three_versions, tmp_path, capsys, argv, says):
    """``--create ""`` (a script's unset variable) printed the tags and exit 0 with nothing created,
    ``--create "" --delete keep`` deleted ``keep``, and ``query --version ""`` read the latest version
    instead of a pinned one: an empty value was taken as no option."""
    uri = three_versions
    versions.set_tag(uri, store.FEATURES, "keep", 2)
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={tmp_path}"])
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], captured.err
    assert captured.out == ""
    assert {k: v["version"] for k, v in store.dataset(uri, store.FEATURES).tags.list().items()} == {"keep": 2}


@pytest.mark.parametrize("order", [[0, 0, 2], [2, 2, 2], [1], [2, 0], [2, 1, 0]])
def test_a_destination_in_the_stored_dtype_gets_the_layers_its_order_names(tmp_path, order):
    """The read straight into a destination in the stored dtype (the trainer's fast path) placed each
    stored layer once: an order naming a layer twice got the layers of another order, silently
    (``[0, 0, 2]`` read as ``[1, 0, 2]``), and one naming fewer layers was refused, where the converting
    copy (another dtype) gives exactly the layers named."""
    import torch

    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b", "c"], m), meta=m)
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        plain = [(s.aux_stored().clone(), s.last_stored().clone()) for s in r.read(range(3))]
        for dtype in (torch.float32, torch.float64):  # straight into the destination / the converting copy
            into = [Into(aux=torch.full((3, len(order), m.hidden_size), -1.0, dtype=dtype),
                         last=torch.empty(3, m.hidden_size, dtype=dtype), order=order) for _ in range(3)]
            r.read(range(3), into=into)
            for (aux, last), dest in zip(plain, into, strict=True):
                assert torch.equal(dest.aux, aux[:3, order].to(dtype)), (dtype, order)
                assert torch.equal(dest.last, last[:3].to(dtype))


@pytest.mark.parametrize("name", [store.FEATURES, store.PROMPTS])
@pytest.mark.parametrize("change, says", [
    (lambda t: t.append_column("weight", pa.array([0.5] * t.num_rows)), "column(s) 'weight' are not stored"),
    (lambda t: t.append_column("domain", pa.array(["x"] * t.num_rows)), "column 'domain' is given 2 times"),
])
def test_a_column_the_table_does_not_store_is_refused_not_dropped(tmp_path, name, change, says):
    """An extra column was dropped without a word (its values lost), and a column given twice was a
    ``KeyError`` saying the column did not exist."""
    uri, m = str(tmp_path / "store"), H.meta()
    rows = H.table(["a", "b"], m) if name == store.FEATURES else \
        pa.Table.from_pylist(H.prompt_rows(2), schema=S.PROMPTS_SCHEMA)
    meta = m if name == store.FEATURES else None
    with pytest.raises(SchemaError, match=f"write to '{name}': ") as exc:
        store.append(uri, name, change(rows), meta=meta)
    assert says in str(exc.value) and "nothing was written" in str(exc.value)
    assert not store.exists(uri, name)
    assert store.append(uri, name, rows, meta=meta) == 2  # the same rows without it are stored


@pytest.mark.parametrize("storage", ["raw", "fp8_e4m3"])
def test_a_stored_value_of_the_wrong_size_is_named_by_row_on_every_read_path(tmp_path, monkeypatch, storage):
    """A row an unchecking writer stored with a short value: the held sample and the converting copy
    said ``tensor of 112 elements cannot be shaped (5, 3, 8)`` (fp8: ``fp8 value of N bytes ...``),
    naming neither the row nor the column; the read straight into a destination named both."""
    import torch

    m = dataclasses.replace(H.meta(), storage=storage)
    uri, rows = str(tmp_path / "store"), H.rows(["a", "b-short"], m)
    if storage == "fp8_e4m3":
        for r in rows:
            for col, shape in (("aux_hidden", (r["num_tokens"], 3, 8)), ("last_hidden", (r["num_tokens"], 8))):
                r[col] = S.encode_value(S.decode_tensor(r[col], shape, "float32").copy(), m)
    rows[1]["aux_hidden"] = rows[1]["aux_hidden"][:-32]
    with monkeypatch.context() as patch:
        patch.setattr(S, "row_problem", lambda table, meta: None)
        store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    with SampleReader(store.dataset(uri, store.FEATURES)) as r:
        r.read([0])[0].aux_stored()  # the intact row reads
        with pytest.raises(SchemaError, match=r"^row 1: aux_hidden holds \d+ bytes, not"):
            r.read([1])[0].aux_stored()
        into = [Into(aux=torch.empty(3, 3, 8, dtype=torch.float64), last=torch.empty(3, 8, dtype=torch.float64))]
        with pytest.raises(SchemaError, match=r"^row 1: aux_hidden holds \d+ bytes, not"):
            r.read([1], into=into)


def test_a_commit_of_no_fragments_makes_no_version(tmp_path):
    """Workers that all wrote no rows (``write_fragment`` of none returns ``[]``): the driver's commit
    made an empty version with lineage claiming an append, where ``store.append`` of no rows makes none."""
    from eaglenest.featurestore.table import fragments

    uri, m = str(tmp_path / "store"), H.meta()
    assert store.append(uri, store.FEATURES, H.table(["a"], m), meta=m) == 2
    empty = fragments.write_fragment(uri, store.FEATURES, H.table([], m), meta=m)
    assert empty == []
    assert fragments.commit_fragments(uri, store.FEATURES, empty, meta=m, lineage={"stage": "capture"}) == 2
    assert [v["version"] for v in versions.list_versions(uri, store.FEATURES)] == [1, 2]
