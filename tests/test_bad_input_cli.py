"""Bad input to the stage CLIs, the way a new user hits it: exit code 2, one line on stderr naming the
key or file, nothing written. No engine starts: every input here is refused before one would.

Each case was found by a bad-input audit: before its fix it printed a traceback, an unclear line
(Lance's internal file names), passed where ``ingest build`` then failed, reached vLLM, or left a
directory behind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.table import store
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.pipeline.train_cli import main as train_main

sys.path.insert(0, str(Path(__file__).resolve().parent / "featurestore"))
import fs_helpers as H  # noqa: E402


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def recipe(root):
    return f"--recipe={root / 'recipes' / 'toy.yaml'}"


@pytest.mark.parametrize("main, argv, key", [
    (ingest_main, ["build", "ingest.engine.max_model_len=-1"], "ingest.engine.max_model_len"),
    (ingest_main, ["build", "ingest.engine.tensor_parallel_size=0"], "ingest.engine.tensor_parallel_size"),
    (featurestore_main, ["capture", "featurestore.engine.max_num_seqs=0"], "featurestore.engine.max_num_seqs"),
    (evaluate_main, ["al", "evaluate.engine.memory_fraction=1.5"], "evaluate.engine.memory_fraction"),
    (ingest_main, ["build", "ingest.engine.seed=-1"], "ingest.engine.seed"),  # numpy, seeded with it, refuses
    (evaluate_main, ["al", "evaluate.engine.seed=4294967296"], "evaluate.engine.seed"),
])
def test_engine_settings_are_checked_before_an_engine_starts(tmp_path, capsys, recipe, main, argv, key):
    work = tmp_path / "work"
    assert main([*argv, recipe, f"run.workdir={work}"]) == 2
    assert _one_line(capsys).startswith(f"{main.__module__.split('.')[1]}: error: {key}: must be")
    assert not work.exists()


@pytest.mark.parametrize("key, value, says", [
    ("max_tokens", "0", "must be >= 1, got 0"),
    ("max_tokens", "-1", "must be >= 1, got -1"),
    ("temperature", "-1.0", "must be in [0, 2], got -1.0"),
    ("temperature", "1e300", "must be in [0, 2], got 1e+300"),
    ("bucket_max_tokens", "-1", "must be >= 1, got -1"),
    ("throughput_max_tokens", "0", "must be >= 1, got 0"),
    ("max_prompts_per_domain", "-1", "must be >= 0 (0: all), got -1"),
])
def test_sampling_values_vllm_refuses_are_refused_before_an_engine_starts(tmp_path, capsys, recipe, key, value, says):
    work = tmp_path / "work"
    assert evaluate_main(["al", recipe, f"run.workdir={work}", f"evaluate.{key}={value}"]) == 2
    assert _one_line(capsys) == f"evaluate: error: evaluate.{key}: {says}"
    assert not work.exists()


def test_empty_workdir_is_refused(tmp_path, capsys, recipe, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" would have meant the current directory
    assert train_main(["run", recipe, "run.workdir="]) == 2
    assert _one_line(capsys).startswith("train: error: run.workdir: must not be empty")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("data, says", [
    ("", "has no rows"),
    ('{"prompt": "a"}\n{bad\n', "line 2 is not valid JSON"),
    ('{"text": "a"}\n', "has no column 'prompt'"),
])
def test_ingest_validate_reads_local_sources(tmp_path, capsys, recipe, data, says):
    src = tmp_path / "src.jsonl"
    src.write_text(data)
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: CC0-1.0\ndomains:\n  d:\n    cap_prompts: 5\n    sources:\n"
                 f"      - path: {src}\n        provenance: test\n")
    work = tmp_path / "work"
    assert ingest_main(["validate", recipe, f"--manifest={m}", f"run.workdir={work}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    # validate lists every problem (key first), then its one summary line
    assert len(lines) == 2 and lines[0].startswith("domains.d.sources[0]") and says in lines[0], lines
    assert str(src) in lines[0] and lines[1] == f"ingest: error: {m}: 1 problem(s)"
    assert not work.exists()


@pytest.mark.parametrize("data, rows, empty", [
    ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', 1, 1),
    ('{"messages": []}\n', 1, 1),
    ('{"messages": [{"role": "user", "content": "  "}]}\n{"messages": [{"role": "user", "content": ""}]}\n', 2, 2),
])
def test_ingest_validate_reports_an_empty_pool_as_build_does(tmp_path, capsys, recipe, data, rows, empty):
    # Before: validate said ok, and build said "0 rows read" of a source with rows (skipped uncounted).
    src = tmp_path / "src.jsonl"
    src.write_text(data)
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: CC0-1.0\ndomains:\n  d:\n    cap_prompts: 5\n    sources:\n"
                 f"      - path: {src}\n        messages_field: messages\n        provenance: test\n")
    work = tmp_path / "work"
    says = (f"{m}: the prompt pool is empty ({rows} rows read: {empty} empty, 0 kept after dedup and caps, "
            "0 of them contaminated)")
    assert ingest_main(["validate", recipe, f"--manifest={m}", f"run.workdir={work}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [says, f"ingest: error: {m}: 1 problem(s)"]
    assert ingest_main(["build", recipe, f"--manifest={m}", f"run.workdir={work}"]) == 2
    assert _one_line(capsys) == f"ingest: error: {says}"
    assert not work.exists()


@pytest.mark.parametrize("key, value, says", [
    ("run.target", "~nosuchuser_eaglenest/x", "~nosuchuser_eaglenest/x: unknown user in ~"),
    ("run.workdir", "~nosuchuser_eaglenest/x", "~nosuchuser_eaglenest/x/ingest: unknown user in ~"),
    ("run.store", "~nosuchuser_eaglenest/x", "~nosuchuser_eaglenest/x: unknown user in ~"),
    ("run.target", "{tmp}/loop", "{tmp}/loop: symlink loop"),
    ("run.workdir", "{tmp}/loop/w", "{tmp}/loop/w/ingest: symlink loop"),
    ("run.workdir", "{tmp}/" + "w" * 5000, "/ingest: name too long"),
])
def test_awkward_run_paths_are_one_line_naming_the_key(tmp_path, capsys, recipe, key, value, says):
    # Before: RuntimeError / OSError tracebacks from expanduser, mkdir and the writability check.
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    before = _files(tmp_path)
    argv = ["build", recipe, f"run.workdir={tmp_path / 'work'}", f"{key}={value.format(tmp=tmp_path)}"]
    assert ingest_main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith(f"ingest: error: {key}: ") and line.endswith(says.format(tmp=tmp_path)), line
    assert len(line) < 200 and _files(tmp_path) == before


def test_a_store_refused_after_the_workdir_check_leaves_no_workdir(tmp_path, capsys, recipe):
    afile = tmp_path / "afile"
    afile.write_text("")
    work = tmp_path / "x" / "wd"
    assert ingest_main(["build", recipe, f"run.workdir={work}", f"run.store={afile / 'store'}"]) == 2
    assert _one_line(capsys) == f"ingest: error: run.store: cannot write to {afile / 'store'} (Not a directory)"
    assert _files(tmp_path) == ["afile"]  # before: x/wd/ingest was left behind


@pytest.mark.parametrize("verb", [["show"], ["versions"], ["compact"], ["restore", "--v", "1"],
                                  ["gc", "--older-than-hours", "1"], ["tags", "--create", "x"]])
def test_a_store_that_is_not_there_is_refused_untouched(tmp_path, capsys, recipe, verb):
    missing = tmp_path / "nope" / "store"
    assert featurestore_main([*verb, recipe, f"run.workdir={tmp_path / 'work'}", f"run.store={missing}"]) == 2
    assert _one_line(capsys) == (f"featurestore: error: run.store: no store at {missing} "
                                 "(check run.store, or run `ingest build` first)")
    assert _files(tmp_path) == []


@pytest.fixture
def features_store(tmp_path):
    uri = tmp_path / "store"
    m = H.meta()
    store.append(str(uri), store.FEATURES, H.table(["a", "b"], m), meta=m)
    return uri


@pytest.mark.parametrize("verb", [["compact"], ["gc", "--older-than-hours", "1"], ["restore", "--v", "1"],
                                  ["tags", "--create", "x"], ["verify"]])
def test_a_table_that_is_not_there_gets_no_lease_files(tmp_path, capsys, recipe, features_store, verb):
    before = _files(features_store)
    argv = [*verb, recipe, f"run.workdir={tmp_path / 'work'}", f"run.store={features_store}",
            "featurestore.table=other"]
    assert featurestore_main(argv) == 2
    line = _one_line(capsys)
    assert line.startswith("featurestore: error: featurestore.table: no table 'other'") and "features" in line
    assert _files(features_store) == before


@pytest.mark.parametrize("verb, says", [
    (["checkout", "--v", "99"], "has no version 99 (the latest is {latest};"),
    (["verify", "--version", "99"], "has no version 99 (the latest is {latest};"),
    (["diff", "--a", "1", "--b", "nosuch"], "has no tag 'nosuch' (tags: none;"),
])
def test_a_version_that_is_not_there_is_one_clear_line(tmp_path, capsys, recipe, features_store, verb, says):
    assert featurestore_main([*verb, recipe, f"run.workdir={tmp_path / 'work'}", f"run.store={features_store}"]) == 2
    line = _one_line(capsys)
    latest = store.latest_version(str(features_store), store.FEATURES)
    assert says.format(latest=latest) in line and "table 'features'" in line
    assert ".rs:" not in line and "_versions" not in line  # not Lance's internals


@pytest.mark.parametrize("extra, says", [
    (["--attach", "results"], "--attach 'results': expected name=file.parquet (or name=file.csv)"),
    (["--attach", "=r.csv"], "--attach '=r.csv': expected name=file.parquet (or name=file.csv)"),
    (["--max-rows", "-1"], "--max-rows: must be >= 0, got -1"),
])
def test_query_options_are_checked(tmp_path, capsys, recipe, features_store, extra, says):
    argv = ["query", "--sql", "SELECT 1", *extra, recipe, f"run.workdir={tmp_path / 'work'}",
            f"run.store={features_store}"]
    assert featurestore_main(argv) == 2
    assert _one_line(capsys) == f"featurestore: error: {says}"


def test_capture_refusing_its_layers_leaves_no_folder(tmp_path, capsys, recipe, tiny_target):
    work = tmp_path / "work"
    row = dict(sample_id="s0", domain="d", source="test", split="train", mode="chat",
               messages_json=json.dumps([{"role": "user", "content": "hi"}]), prompt_token_ids=[3, 4],
               response_token_ids=[5, 6], finish_reason="stop", gen_params_id="g")
    store.append(str(work / "store"), store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))
    argv = ["capture", recipe, f"run.workdir={work}", f"run.target={tiny_target}", "run.off_policy=true",
            "featurestore.layer_ids=[100]"]
    assert featurestore_main(argv) == 2
    assert _one_line(capsys).startswith("featurestore: error: featurestore.layer_ids: [100] outside")
    assert not (work / "featurestore").exists()  # no empty folder left by the writability check


def test_stream_serve_refuses_a_negative_rank_before_connecting(capsys):
    # Port 1 on loopback: nothing listens there, so only a check made before connecting gives this line.
    assert featurestore_main(["stream-serve", "--addr", "127.0.0.1:1", "--engine-rank", "-1", "--timeout-s", "30"]) == 2
    assert _one_line(capsys) == "featurestore: error: --engine-rank -1: must be >= 0 (0..train.stream.engines-1)"


@pytest.mark.parametrize("text, says", [
    ("x", "is not a readable JSON report"),
    ("[1, 2]", "is not an `evaluate al` report.json"),
    ('{"draft": "d"}', "is not an `evaluate al` report.json"),
])
def test_compare_refuses_a_json_file_that_is_not_a_report(tmp_path, capsys, recipe, text, says):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    work = tmp_path / "work"
    assert evaluate_main(["compare", "--a", str(bad), "--b", str(bad), recipe, f"run.workdir={work}"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"evaluate: error: compare: {bad} ") and says in line
    assert not work.exists()


def test_a_recipe_or_manifest_path_that_is_a_directory_says_so(tmp_path, capsys, recipe):
    assert train_main(["run", f"--recipe={tmp_path}", "--dry-run"]) == 2
    assert _one_line(capsys) == f"train: error: {tmp_path}: is a directory, not a YAML file"
    assert ingest_main(["validate", recipe, f"--manifest={tmp_path}", f"run.workdir={tmp_path / 'work'}"]) == 2
    assert _one_line(capsys) == f"ingest: error: {tmp_path}: is a directory, not a YAML file"
    assert _files(tmp_path) == []


@pytest.mark.parametrize("text, says", [("{bad", "is not valid JSON"), ("[1]", "is not a JSON object")])
def test_a_target_with_a_broken_config_is_refused_before_anything_is_written(tmp_path, capsys, recipe, text, says):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(text)
    work = tmp_path / "work"
    assert ingest_main(["build", recipe, f"run.workdir={work}", f"run.target={target}"]) == 2
    assert _one_line(capsys).startswith(f"ingest: error: run.target: {target}/config.json {says}")
    assert not work.exists()  # before: a transformers traceback, with <workdir>/ingest and a store lease left


@pytest.mark.parametrize("text, says", [("{bad", "not valid JSON"), ("[1]", "not a JSON object")])
def test_a_draft_with_a_broken_config_is_one_line(tmp_path, capsys, recipe, text, says):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(text)
    work = tmp_path / "work"
    assert evaluate_main(["al", recipe, f"run.workdir={work}", f"evaluate.draft={draft}"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"evaluate: error: {draft}/config.json: {says}") and "serve export" in line
    assert not work.exists()


@pytest.mark.parametrize("text, says", [("{bad", "not valid JSON"), ('"x"', "not a JSON object")])
def test_serve_export_of_a_damaged_checkpoint_is_one_line(tmp_path, capsys, recipe, text, says):
    from eaglenest.serve.cli import main as serve_main

    ckpt = tmp_path / "work" / "train"
    ckpt.mkdir(parents=True)
    (ckpt / "checkpoint.json").write_text(text)
    before = _files(tmp_path)
    assert serve_main(["export", recipe, f"run.workdir={tmp_path / 'work'}"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"serve: error: {ckpt}/checkpoint.json: {says}") and "train run" in line
    assert _files(tmp_path) == before


@pytest.mark.parametrize("text, want", [("1e-3", 0.001), ("2E-4", 0.0002), ("+5e-1", 0.5), (".5e-2", 0.005)])
def test_a_float_with_an_exponent_and_no_dot_is_a_number(capsys, recipe, text, want):
    # PyYAML (YAML 1.1) reads 1e-3 as text: `train.lr=1e-3` was refused as "expected float, got '1e-3'".
    assert train_main(["run", recipe, "--dry-run", f"train.lr={text}"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["lr"] == want


@pytest.mark.parametrize("text, says", [("1e400", "train.lr: must be a finite number"),
                                        ("1e-3x", "train.lr: expected float, got '1e-3x'"),
                                        ("-1e-3", "train.lr: must be > 0, got -0.001")])
def test_a_bad_float_with_an_exponent_is_still_refused(capsys, recipe, text, says):
    assert train_main(["run", recipe, "--dry-run", f"train.lr={text}"]) == 2
    assert _one_line(capsys) == f"train: error: {says}"
