"""Every verb that reads a table's rows holds them to their checksums first (integrity.checked_dataset).

The tables, the damage (16 flipped bytes, mtime restored or not; a truncated or deleted data
file) and the assertions on the line come from tests/faults/test_integrity.py. Then: ``compact``
refuses a damaged table and leaves it as it was (no laundering into a fresh CRC); ``show``,
``checkout``, ``diff``, ``query`` (small columns, tensors) and ``export`` exit 2 with one line
naming the fragment and file, and write nothing; an unreadable or garbled sidecar is one line for
the read paths and a problem for ``verify`` alike; a damaged latest manifest makes ``restore`` one
line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import test_integrity as TI  # noqa: E402  (its table fixture, damage and assertion helpers)

from eaglenest.errors import StoreError  # noqa: E402
from eaglenest.featurestore import cli  # noqa: E402
from eaglenest.featurestore.read import query  # noqa: E402
from eaglenest.featurestore.table import integrity, maintenance, store, versions  # noqa: E402

table = TI.table


def _damage(path: Path, how: str) -> None:
    if how == "truncate":
        os.truncate(path, os.stat(path).st_size // 2)
    elif how == "delete":
        path.unlink()
    else:
        TI._flip(path, keep_mtime=how == "flip-mtime-restored")


def _cli(capsys, uri: str, work: Path, *argv: str) -> tuple[int, list[str]]:
    code = cli.main([*argv, "--recipe", TI.RECIPE, f"run.store={uri}", f"run.workdir={work}"])
    return code, capsys.readouterr().err.strip().splitlines()


def _files(uri: str) -> list[tuple[str, int]]:
    root = Path(uri)
    return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*")
                  if p.is_file() and ".lease" not in p.name and not p.name.endswith(".stamp"))


@pytest.mark.parametrize("how", ["flip", "flip-mtime-restored", "truncate"])
def test_compact_refuses_a_damaged_table_and_changes_nothing(table, how):
    uri, files = table
    fid, path = files[1]
    _damage(path, how)
    before_version, before = store.latest_version(uri, store.FEATURES), _files(uri)
    with pytest.raises(StoreError) as err:
        maintenance.compact(uri, store.FEATURES)
    TI._assert_names(err.value, fid, path)
    assert store.latest_version(uri, store.FEATURES) == before_version and _files(uri) == before
    assert not maintenance.verify(uri, store.FEATURES)["ok"]  # the damage is still there to be seen


def test_compact_of_an_intact_table_still_compacts(table):
    uri, files = table
    report = maintenance.compact(uri, store.FEATURES)
    assert report["fragments_before"] == len(files) and report["fragments_after"] == 1
    assert maintenance.verify(uri, store.FEATURES)["ok"]


VERBS = {
    "show": ["show"],
    "checkout": ["checkout", "--v", "{latest}"],
    "diff": ["diff", "--a", "1", "--b", "{latest}"],
    "compact": ["compact"],
    "query": ["query", "--sql", "SELECT count(*) FROM features"],
    "query-tensors": ["query", "--with-tensors", "--sql", "SELECT md5(aux_hidden) FROM features"],
    "query-out": ["query", "--sql", "SELECT sample_id FROM features", "--out", "{work}/q.parquet"],
    "export": ["export", "--format", "speculators", "--out", "{work}/exp"],
}


@pytest.mark.parametrize("how", ["flip-mtime-restored", "truncate", "delete"])
@pytest.mark.parametrize("verb", list(VERBS))
def test_read_verbs_refuse_a_damaged_file_with_one_line(table, tmp_path, capsys, verb, how):
    uri, files = table
    fid, path = files[1]
    _damage(path, how)
    work = tmp_path / "work"
    work.mkdir()
    before, latest = _files(uri), store.latest_version(uri, store.FEATURES)
    code, err = _cli(capsys, uri, work, *[a.format(work=work, latest=latest) for a in VERBS[verb]])
    assert code == 2 and len(err) == 1 and err[0].startswith("featurestore: error:"), err
    assert f"fragment {fid}" in err[0] and str(path) in err[0], err
    assert "Traceback" not in err[0] and "Python exception" not in err[0]
    assert list(work.iterdir()) == [] and _files(uri) == before  # nothing written, nothing rewritten


def test_query_and_export_read_an_intact_table(table, tmp_path):
    uri, _ = table
    assert query.run_query(uri, "SELECT count(*) AS n FROM features").column("n").to_pylist() == [10]
    t = query.run_query(uri, "SELECT md5(aux_hidden) AS h FROM features", with_tensors=True)
    assert t.num_rows == 10


def test_an_in_place_edit_of_a_small_column_is_caught_by_query(table):
    """A sample_id edited in place (same length, so the file still decodes) is not read back."""
    uri, files = table
    fid, path = files[0]
    data = path.read_bytes()
    at = data.find(b"c0s3")
    assert at >= 0
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"c0sX")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(StoreError, match="fails its checksum") as err:
        query.run_query(uri, "SELECT sample_id FROM features")
    TI._assert_names(err.value, fid, path)


@pytest.mark.parametrize("bad", ["directory", "garbled", "empty"])
def test_an_unreadable_sidecar_is_one_line_for_readers_and_a_problem_for_verify(table, bad):
    uri, files = table
    fid, path = files[0]
    side = path.parents[1] / integrity.CRC_DIR / f"{path.name}.crc"
    side.unlink()
    if bad == "directory":
        side.mkdir()
    else:
        side.write_text("not a crc\n" if bad == "garbled" else "")
    with pytest.raises(StoreError, match="checksum sidecar") as err:
        TI._read_all(uri)  # the trainer's path
    TI._assert_names(err.value, fid, path)
    assert str(side) in str(err.value)
    report = maintenance.verify(uri, store.FEATURES)
    assert not report["ok"] and any(f"fragment {fid}" in p and str(side) in p for p in report["problems"])
    with pytest.raises(StoreError, match="checksum sidecar"):
        versions.summary(uri, store.FEATURES)


def test_restore_over_a_damaged_latest_manifest_is_one_line(table, tmp_path, capsys):
    uri, _ = table
    manifests = sorted((store.table_path(uri, store.FEATURES) / "_versions").glob("*.manifest"),
                       key=lambda p: p.stat().st_mtime_ns)
    TI._flip(manifests[-1])
    code, err = _cli(capsys, uri, tmp_path, "restore", "--v", "1")
    assert code == 2 and len(err) == 1 and "features" in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize("verb", ["show", "checkout", "diff", "compact", "query", "query-tensors", "export"])
def test_damage_the_check_cannot_see_is_still_one_line(table, tmp_path, capsys, monkeypatch, verb):
    """A file truncated after the check (or with no sidecar to hold it to): the Lance error is one
    line naming the table, not an ArrowInvalid/OSError traceback nor DuckDB's wrapped one."""
    uri, files = table
    monkeypatch.setattr(integrity, "check_version", lambda ds, table=None: integrity.Report())
    for _, path in files:
        os.truncate(path, os.stat(path).st_size // 2)
    work = tmp_path / "work"
    work.mkdir()
    latest = store.latest_version(uri, store.FEATURES)
    code, err = _cli(capsys, uri, work, *[a.format(work=work, latest=latest) for a in VERBS[verb]])
    err = [e for e in err if "hidden states:" not in e]  # export's progress bar, before the failing read
    assert code == 2 and len(err) == 1 and "features" in err[0] and "verify" in err[0], err
    assert "Traceback" not in err[0] and "Python exception" not in err[0] and list(work.iterdir()) == []
