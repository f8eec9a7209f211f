"""The store's CLI, sixth pass: ``show`` lists every table when one cannot be read (marked, then exit 2
naming it); a filter Lance refuses is one line naming the filter; ``gc`` refuses a table whose latest
data files fail their checksums (after a ``compact`` the old versions hold the only intact copy) and
says it removed nothing; a damaged newest manifest is one line without Lance's Rust source lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fs_helpers as H
from eaglenest.errors import StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.table import maintenance, store, versions

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def _cli(capsys, uri: str, *argv: str) -> tuple[int, str, list[str]]:
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={Path(uri).parent}"])
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def _data_files(uri: str, name: str) -> list[Path]:
    return sorted((Path(uri) / f"{name}.lance" / "data").iterdir())


def _newest_manifest(uri: str, name: str) -> Path:
    """The latest version's manifest (Lance's v2 naming counts down from 2^64-1)."""
    version = store.latest_version(uri, name)
    folder = Path(uri) / f"{name}.lance" / "_versions"
    (path,) = [folder / f"{n}.manifest" for n in (version, 2**64 - 1 - version) if (folder / f"{n}.manifest").is_file()]
    return path


@pytest.fixture
def three_tables(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    for name in ("aaa", store.FEATURES, "zzz"):
        store.append(uri, name, H.table([f"{name}-1", f"{name}-2"], m), meta=m)
    return uri


# -- 1: show lists every table, marks the unreadable one, exits 2 at the end -----------------------

@pytest.mark.parametrize("damage", ["data file deleted", "manifest garbled"])
def test_show_lists_every_table_and_names_the_unreadable_one(three_tables, capsys, damage):
    """It stopped at the first table it could not read ('aaa'), printing nothing about the others."""
    if damage == "data file deleted":
        _data_files(three_tables, "aaa")[0].unlink()
    else:
        _newest_manifest(three_tables, "aaa").write_bytes(b"garbage")
    code, out, err = _cli(capsys, three_tables, "show")
    report = json.loads(out)
    assert code == 2 and len(err) == 1, err
    assert sorted(report["tables"]) == ["aaa", "features", "zzz"]
    assert set(report["tables"]["aaa"]) == {"error"} and "table 'aaa'" in report["tables"]["aaa"]["error"]
    assert err[0] == f"featurestore: error: {report['tables']['aaa']['error']}", err
    for name in ("features", "zzz"):
        assert report["tables"][name]["rows"] == 2 and report["tables"][name]["counts"] == {"d/train": 2}


def test_show_names_every_unreadable_table_last(three_tables, capsys):
    for name in ("aaa", "zzz"):
        _data_files(three_tables, name)[0].unlink()
    code, out, err = _cli(capsys, three_tables, "show")
    report = json.loads(out)
    assert code == 2 and len(err) == 1 and report["tables"]["features"]["rows"] == 2, err
    assert err[0] == (f"featurestore: error: {report['tables']['aaa']['error']}; table(s) zzz cannot be read "
                      "either (the report above says why)"), err
    assert "table 'zzz'" in report["tables"]["zzz"]["error"]


def test_show_of_readable_tables_exits_0(three_tables, capsys):
    code, out, err = _cli(capsys, three_tables, "show")
    assert code == 0 and err == [] and sorted(json.loads(out)["tables"]) == ["aaa", "features", "zzz"]


# -- 2: a filter Lance refuses is one line naming it ------------------------------------------------

@pytest.mark.parametrize("filter_, says", [
    ("nosuch = 1", "No field named nosuch"),
    ("split = 'train' AND", "sql parser error"),
    ("num_tokens = 'x'", "could not convert"),
])
@pytest.mark.parametrize("how", ["read", "iter_batches", "sample_ids"])
def test_a_filter_lance_refuses_is_one_line_naming_it(three_tables, filter_, says, how):
    """A bare ``ValueError`` ending in Lance's Rust source paths (a traceback from any CLI) before."""
    calls = {"read": lambda: store.read(three_tables, store.FEATURES, columns=["sample_id"], filter=filter_),
             "iter_batches": lambda: list(store.iter_batches(three_tables, store.FEATURES, filter=filter_)),
             "sample_ids": lambda: store.sample_ids(three_tables, store.FEATURES, filter=filter_)}
    with pytest.raises(StoreError) as info:
        calls[how]()
    msg = str(info.value)
    assert msg.startswith(f"table 'features' in {three_tables}: the filter {filter_!r} is refused ("), msg
    assert says in msg and ".rs:" not in msg and "\n" not in msg, msg


def test_a_good_filter_still_reads(three_tables):
    got = store.read(three_tables, store.FEATURES, columns=["sample_id"], filter="sample_id = 'features-2'")
    assert got.column("sample_id").to_pylist() == ["features-2"]


# -- 3: gc refuses a damaged latest version: the old versions hold the only intact copy ------------

def _compacted_then_damaged(tmp_path) -> tuple[str, list[Path]]:
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"a{k}", f"b{k}"], m), meta=m)
    assert maintenance.compact(uri, store.FEATURES)["fragments_after"] == 1
    files = _data_files(uri, store.FEATURES)
    assert len(files) == 4  # three originals, one compacted
    latest = store.dataset(uri, store.FEATURES)
    (compacted,) = [Path(uri) / "features.lance" / "data" / Path(df.path).name
                    for fr in latest.get_fragments() for df in fr.data_files()]
    data = bytearray(compacted.read_bytes())
    data[100] ^= 0xFF  # same size: only the checksum tells
    compacted.write_bytes(bytes(data))
    return uri, files


def test_gc_refuses_a_compacted_table_whose_new_file_is_damaged(tmp_path, capsys):
    """``gc`` deleted the three original files, the only intact copy of the rows, and exited 0."""
    uri, files = _compacted_then_damaged(tmp_path)
    before = store.version_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES)
    code, _, err = _cli(capsys, uri, "gc", "--older-than-hours", "0", "--grace-hours", "0")
    assert code == 2 and len(err) == 1, err
    assert "fails its checksum" in err[0] and err[0].endswith("; gc removed nothing"), err
    assert _data_files(uri, store.FEATURES) == files
    assert store.version_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES) == before
    assert len(before) > 2


def test_gc_of_an_intact_compacted_table_still_removes_the_old_files(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"a{k}", f"b{k}"], m), meta=m)
    maintenance.compact(uri, store.FEATURES)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
    assert report["versions_after"] == [store.latest_version(uri, store.FEATURES)]
    assert len(_data_files(uri, store.FEATURES)) == 1


# -- 4: a damaged newest manifest: one line, no Rust source lines ----------------------------------

@pytest.mark.parametrize("verb", [["gc", "--older-than-hours", "0"], ["versions"], ["compact"]])
def test_a_damaged_newest_manifest_is_one_line_saying_what_to_do(three_tables, capsys, verb):
    """It was Lance's text alone, ending in its Rust source path (…/lance-io/src/utils.rs:224:20)."""
    manifest = _newest_manifest(three_tables, store.FEATURES)
    manifest.write_bytes(b"garbage")
    before = sorted(os.listdir(manifest.parent))
    code, _, err = _cli(capsys, three_tables, *verb)
    assert code == 2 and len(err) == 1, err
    assert f"table 'features' in {three_tables}: cannot open its latest version (" in err[0], err
    assert "a file under features.lance/_versions is damaged or missing: restore it from a backup" in err[0]
    assert ".rs:" not in err[0], err
    assert sorted(os.listdir(manifest.parent)) == before


# -- 5: query --attach a file whose name the OS cannot take -----------------------------------------

def test_query_attach_of_a_name_too_long_is_one_line(three_tables, capsys, tmp_path):
    """``Path.is_file`` raises ``OSError: [Errno 36] File name too long`` (a traceback, exit 1)."""
    long = tmp_path / ("n" * 300 + ".csv")
    code, out, err = _cli(capsys, three_tables, "query", "--sql", "SELECT * FROM x", "--attach", f"x={long}")
    assert code == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("featurestore: error: --attach x: ") and err[0].endswith(": name too long"), err


# -- 6: a damaged tag file ------------------------------------------------------------------------------

@pytest.mark.parametrize("verb", [["versions"], ["tags"], ["tags", "--create", "x"], ["tags", "--delete", "good"],
                                  ["gc", "--older-than-hours", "0", "--grace-hours", "0"]])
def test_a_damaged_tag_file_is_one_line_and_gc_removes_nothing(tmp_path, capsys, verb):
    """``_refs/tags/good.json`` garbled: Lance's ``RuntimeError`` (``OSError`` under gc) was a traceback
    on every verb that lists the tags; gc cannot tell which versions are tagged, so it must keep all."""
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"a{k}"], m), meta=m)
    versions.set_tag(uri, store.FEATURES, "good", 2)
    (tag_file,) = (Path(uri) / "features.lance" / "_refs" / "tags").iterdir()
    tag_file.write_text("{garbage")
    before = store.version_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES)
    code, _, err = _cli(capsys, uri, *verb)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"featurestore: error: table 'features' in {uri}: cannot read its tags (") and \
        "a file under features.lance/_refs/tags is damaged" in err[0] and ".rs:" not in err[0], err
    assert store.version_list(store.dataset(uri, store.FEATURES), uri, store.FEATURES) == before
    assert tag_file.read_text() == "{garbage"


def test_show_marks_a_table_whose_tags_are_damaged(three_tables, capsys):
    versions.set_tag(three_tables, "zzz", "good", 2)
    (tag_file,) = (Path(three_tables) / "zzz.lance" / "_refs" / "tags").iterdir()
    tag_file.write_text("{garbage")
    code, out, err = _cli(capsys, three_tables, "show")
    report = json.loads(out)
    assert code == 2 and "cannot read its tags" in report["tables"]["zzz"]["error"], report
    assert err == [f"featurestore: error: {report['tables']['zzz']['error']}"]
    assert report["tables"]["aaa"]["rows"] == 2 and report["tables"]["features"]["rows"] == 2
