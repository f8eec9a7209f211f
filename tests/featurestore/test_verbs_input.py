"""Bad input to the store's verbs is one line and exit 2, nothing written (QA pass on the verbs).

Version numbers (ASCII digits, 64-bit), ``gc`` hours far past any version's age, tag names Lance
refuses, a tag moved or a ``--version`` without ``--create``, ``query --attach`` names and files
DuckDB would refuse with a traceback, query errors that echo a huge input, and the hints for a
store without the queried table and for a tensor column asked for without ``--with-tensors``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest

import fs_helpers as H

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import maintenance, names, store, versions

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


@pytest.fixture()
def uri(tmp_path) -> str:
    uri, m = str(tmp_path / "store"), H.meta()
    for c in range(3):
        store.append(uri, store.FEATURES, H.table([f"c{c}s{i}" for i in range(3)], m, seed=c), meta=m)
    return uri


def _cli(capsys, uri: str, *argv: str) -> tuple[int, list[str]]:
    code = cli.main([*argv, "--recipe", RECIPE, f"run.store={uri}", f"run.workdir={Path(uri).parent}"])
    return code, capsys.readouterr().err.strip().splitlines()


def _one_line(code: int, err: list[str], *says: str) -> str:
    assert code == 2 and len(err) == 1 and err[0].startswith("featurestore: error:"), err
    assert all(s in err[0] for s in says) and "Traceback" not in err[0] and len(err[0]) < 600, err
    return err[0]


@pytest.mark.parametrize("text, want", [
    (None, None), ("7", 7), ("007", 7), ("good", "good"), (str(2**63 - 1), 2**63 - 1),
])
def test_version_arg_accepts_numbers_and_tags(text, want):
    assert names.version_arg(text) == want


@pytest.mark.parametrize("text", ["99999999999999999999", str(2**63), "1" * 5000, "²", "٣", "1²"])
def test_version_arg_refuses_what_is_no_version_number(text):
    with pytest.raises(ConfigError, match="--v "):
        names.version_arg(text, "--v")


@pytest.mark.parametrize("verb", [
    ["checkout", "--v", "{bad}"], ["restore", "--v", "{bad}"], ["diff", "--a", "1", "--b", "{bad}"],
    ["query", "--sql", "SELECT 1", "--version", "{bad}"], ["tags", "--create", "x", "--version", "{bad}"],
    ["verify", "--version", "{bad}"], ["export", "--format", "hf", "--out", "{out}", "--version", "{bad}"],
])
@pytest.mark.parametrize("bad", ["99999999999999999999", "²", "٣"])
def test_bad_version_numbers_are_one_line_on_every_verb(uri, tmp_path, capsys, verb, bad):
    before = store.latest_version(uri, store.FEATURES)
    code, err = _cli(capsys, uri, *[a.format(bad=bad, out=tmp_path / "out") for a in verb])
    _one_line(code, err, bad)
    assert store.latest_version(uri, store.FEATURES) == before and not (tmp_path / "out").exists()
    assert versions.list_versions(uri, store.FEATURES)[-1]["tags"] == []


@pytest.mark.parametrize("hours", [1e10, 1e12, 1e300])
def test_gc_with_hours_past_any_version_age_keeps_everything(uri, hours):
    before = [v["version"] for v in versions.list_versions(uri, store.FEATURES)]
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=hours, grace_hours=hours)
    assert report["versions_after"] == before and report["uncommitted_files_removed"] == 0


@pytest.mark.parametrize("bad", ["a..b", "a.", "a.lock", "v1.b.lock", "a" * 129])
def test_tag_names_lance_refuses_are_refused_first(uri, capsys, bad):
    with pytest.raises(StoreError, match="bad tag name"):
        versions.set_tag(uri, store.FEATURES, bad, None)
    _one_line(*_cli(capsys, uri, "tags", "--create", bad), "bad tag name")
    assert versions.list_versions(uri, store.FEATURES)[-1]["tags"] == []


@pytest.mark.parametrize("good", ["a.b", "v1.lock.b", "a-b_c", "a.LOCK"])
def test_tag_names_with_inner_dots_still_work(uri, good):
    assert versions.set_tag(uri, store.FEATURES, good, 2) == 2


def test_moving_a_tag_says_which_versions(uri, caplog):
    versions.set_tag(uri, store.FEATURES, "good", 2)
    with caplog.at_level(logging.WARNING, logger="eaglenest.featurestore.table.versions"):
        assert versions.set_tag(uri, store.FEATURES, "good", 3) == 3
        versions.set_tag(uri, store.FEATURES, "good", 3)  # not moved: no warning
    (rec,) = caplog.records
    assert "tag 'good'" in rec.getMessage() and "from version 2 to version 3" in rec.getMessage()


def test_tags_version_without_create_is_refused(uri, capsys):
    _one_line(*_cli(capsys, uri, "tags", "--version", "2"), "--version goes with --create")


@pytest.mark.parametrize("name, file, says", [
    ("features", "a.csv", "is a table of the store already"),
    ("FEATURES", "a.csv", "is a table of the store already"),
    ("select", "a.csv", "not a SQL keyword"),
    ("a-b", "a.csv", "plain identifier"),
    ("ev", "passwd", "use a .parquet, .csv, .json or .jsonl file"),
    ("ev", "broken.parquet", "cannot read it"),
    ("ev", "missing.csv", "no such file"),
])
def test_bad_attach_is_one_line_naming_the_item(uri, tmp_path, capsys, name, file, says):
    (tmp_path / "a.csv").write_text("sample_id,al\nc0s0,3.5\n")
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    item = f"{name}={tmp_path / file}"
    with pytest.raises(ConfigError, match=says):
        query.run_query(uri, "SELECT 1", attach={name: str(tmp_path / file)})
    # the item is named, its path bounded to its last 120 characters (the file name kept)
    _one_line(*_cli(capsys, uri, "query", "--sql", "SELECT 1", "--attach", item), f"--attach {name}=", file, says)


def test_a_good_attach_still_joins(uri, tmp_path):
    (tmp_path / "ev.csv").write_text("sample_id,al\nc0s0,3.5\nc1s1,2.5\n")
    t = query.run_query(uri, "SELECT f.sample_id, e.al FROM features f JOIN ev e USING (sample_id) ORDER BY 1",
                        attach={"ev": str(tmp_path / "ev.csv")})
    assert t.to_pylist() == [{"sample_id": "c0s0", "al": 3.5}, {"sample_id": "c1s1", "al": 2.5}]


@pytest.mark.parametrize("out", [False, True])
def test_query_error_lines_are_bounded(uri, tmp_path, capsys, out):
    col = "x" * 100_000
    argv = ["query", "--sql", f"SELECT {col} FROM features"] + (["--out", str(tmp_path / "q.csv")] if out else [])
    line = _one_line(*_cli(capsys, uri, *argv), "query failed", "xxx")
    assert len(line) < 600 and not (tmp_path / "q.csv").exists()


def test_query_of_a_missing_table_names_the_store_and_its_tables(tmp_path, capsys):
    uri = str(tmp_path / "store")
    row = dict(sample_id="s0", domain="d", source="t", split="train", mode="chat", messages_json="[]",
               prompt_token_ids=[1], response_token_ids=[2], finish_reason="stop", gen_params_id="g")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))
    line = _one_line(*_cli(capsys, uri, "query", "--sql", "SELECT count(*) FROM features"), "features")
    assert uri in line and "has tables: prompts" in line and "featurestore capture" in line


def test_a_tensor_column_without_with_tensors_says_so(uri, capsys):
    _one_line(*_cli(capsys, uri, "query", "--sql", "SELECT aux_hidden FROM features"), "--with-tensors")


def test_usage_text_shows_the_real_options():
    doc = cli.__doc__
    assert 'query --sql "SELECT' in doc and "diff --a A --b B" in doc and "checkout --v V" in doc
    assert "restore --v V" in doc


@pytest.mark.parametrize("split", ["it's", "x' OR '1'='1"])
def test_a_split_name_is_text_in_every_prompts_filter(tmp_path, split):
    """The stream source and the served-AL split check quote the split: a quote is text, not syntax
    (before: a Lance SQL traceback, or a filter widened to every row)."""
    from stream_helpers import FS, prompts

    from eaglenest.pipeline.commands import check_select_split
    from eaglenest.train.stream_source import StreamShards

    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, prompts(3))  # split 'train'
    assert store.sql_text(split) == "'" + split.replace("'", "''") + "'"
    with pytest.raises(StoreError, match="no conversations to train on"):
        StreamShards(uri, featurestore=FS, target="unused", split=split, pack_tokens=64, batch_rows=1, seed=0,
                     depth=1)
    with pytest.raises(ConfigError, match="no .* prompts in"):
        check_select_split(uri, split)
    check_select_split(uri, "train")  # the split that is there passes


@pytest.mark.parametrize("verb", [["show"], ["versions"]])
def test_a_store_path_too_long_for_the_os_is_one_line(tmp_path, capsys, verb):
    """``featurestore show run.store=<a 300-character name>`` was an OSError 'File name too long' traceback."""
    long = str(tmp_path / ("s" * 300))
    line = _one_line(*_cli(capsys, long, *verb), "run.store")
    assert "Traceback" not in line
