"""The bench scripts with bad flags, as a user mistypes them: each ends in one usage line and exit 2
before any work (not a traceback after minutes of set-up, not a run on zero samples), an --out or
--dir that cannot be used is named, a --check can fail, and an interrupted run's results file is
resumed from.

Each script's ``main`` runs in this process with ``sys.argv`` set (several read it themselves); the
refusals come from argparse, so no data is made, no engine or server starts, nothing is imported
past what parsing needs. bench/ is not a package: scripts are loaded from their files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def load(name: str):
    return load_bench(name, "_bench_qa")


@pytest.fixture
def run_main(monkeypatch, capsys, tmp_path):
    """``run_main(script, *args)``: (exit code, stderr, stdout) of the script's ``main`` with ``sys.argv`` set."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # families.py puts bench/ first: dropped after
    # Defaults such as --workdir runs/toy are relative: a script that failed to refuse works in tmp_path,
    # not in this checkout's run folder.
    monkeypatch.chdir(tmp_path)

    def run(name: str, *args: str) -> tuple[int, str, str]:
        if name == "families.py":  # it imports learning_curves from beside it
            monkeypatch.setitem(sys.modules, "learning_curves", load("learning_curves.py"))
        mod = load(name)
        monkeypatch.setattr(sys, "argv", [name, *args])
        with pytest.raises(SystemExit) as exit_:
            mod.main()
        out, err = capsys.readouterr()
        return exit_.value.code, err, out

    return run


# Each: a script, flags a user could give, the line it must answer with. Before the fix each of these
# ran on: a traceback at the end (ZeroDivisionError, IndexError, StopIteration, ValueError) or work on
# nothing (an engine started for zero prompts, a step count of 0 read as "use the default").
BAD_FLAGS = [
    ("featurestore_write.py", ["--samples", "0"], "argument --samples: must be >= 1, got 0"),
    ("featurestore_write.py", ["--commit-every", "0"], "argument --commit-every: must be >= 1, got 0"),
    ("featurestore_write.py", ["--rounds", "-1"], "argument --rounds: must be >= 0, got -1"),
    ("featurestore_write.py", ["--min-tokens", "9", "--max-tokens", "8"], "--min-tokens (9) is above --max-tokens (8)"),
    ("featurestore_read.py", ["--min-tokens", "9", "--max-tokens", "8"], "--min-tokens (9) is above --max-tokens (8)"),
    ("featurestore_read.py", ["--batch-samples", "0"], "argument --batch-samples: must be >= 1, got 0"),
    ("featurestore_layout.py", ["--hidden", "-1"], "argument --hidden: must be >= 1, got -1"),
    ("featurestore_layout.py", ["--chunk-tokens", "0"], "argument --chunk-tokens: must be >= 1, got 0"),
    ("featurestore_blob_layout.py", ["--samples", "0"], "argument --samples: must be >= 1, got 0"),
    ("object_store_read.py", ["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    ("stream_transport.py", ["--frames", "1"], "argument --frames: must be >= 2, got 1"),
    ("stream_transport.py", ["--depth", "0"], "argument --depth: must be >= 1, got 0"),
    ("stream_memory.py", ["--depths", "2,0"], "--depths: a comma list of depths, each >= 1, got '2,0'"),
    ("large_vocab.py", ["--chunks", "0,a"],
     "--chunks: a comma list of train.target_chunk_tokens (0 = plain), got '0,a'"),
    ("large_vocab.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("train_long.py", ["--lengths", "2048,x"], "--lengths: a comma list of tokens per sample, each >= 1, got '2048,x'"),
    ("train_throughput.py", ["--long", "0"], "--long: a comma list of row lengths, each >= 1, got '0'"),
    ("train_throughput.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("ingest_regen.py", ["--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    ("ingest_capture.py", ["--max-tokens", "-1"], "argument --max-tokens: must be >= 1, got -1"),
    ("ingest_dask.py", ["--commit-every", "0"], "argument --commit-every: must be >= 1, got 0"),
    ("ingest_long.py", ["--lengths", "2048", "100"], "argument --lengths: must be >= 256, got 100"),
    ("cpu_threads.py", ["--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    # a target that is no model folder: the arms' engines failed on it, one traceback per arm
    ("cpu_threads.py", ["--target", "no-model"], "--target no-model: not a model folder (no config.json)"),
    ("engine_start.py", ["--target", "no-model"], "--target no-model: not a model folder (no config.json)"),
    ("engine_close.py", ["--target", "no-model"], "--target no-model: not a model folder (no config.json)"),
    ("serve_fp8.py", ["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    ("gpu_check.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("families.py", ["--ks", "2,0"], "argument --ks: a comma list of whole numbers, each >= 1, got '2,0'"),
    ("families.py", ["--families", "eagle3,medusa"], "--families: unknown ['medusa']; one or more of"),
    ("learning_curves.py", ["--epochs", "2,x"],
     "argument --epochs: a comma list of whole numbers, each >= 1, got '2,x'"),
    ("learning_curves.py", ["--variant", "lm_head"], "argument --variant: expected name=override[,override...]"),
    ("featurestore_query_memory.py", ["--sizes", "64,x"], "argument --sizes: two whole MiB counts, got '64,x'"),
]


@pytest.mark.parametrize("name, args, line", BAD_FLAGS,
                         ids=[f"{name[:-3]}{'_'.join(args).replace(',', '.')}" for name, args, _line in BAD_FLAGS])
def test_a_bad_flag_is_one_usage_line_and_exit_2(run_main, name, args, line):
    code, err, _out = run_main(name, *args)
    assert code == 2, (name, args, err[-800:])
    assert "Traceback" not in err
    assert f"{name}: error: {line}" in err, err[-800:]


@pytest.mark.parametrize("sizes", ["256,64", "64,64"])
def test_query_memory_sizes_go_small_then_large(run_main, sizes):
    """``--check`` reads growth at the second size over the first: given large first (or twice the same)
    the ratio of a query that materialises the table came out <= 1 and the check passed it."""
    code, err, _out = run_main("featurestore_query_memory.py", "--sizes", sizes, "--check")
    assert code == 2
    assert f"argument --sizes: two sizes in MiB, the smaller first (64,256), got '{sizes}'" in err


SCRATCH = ["featurestore_write.py", "featurestore_read.py", "featurestore_layout.py", "featurestore_blob_layout.py",
           "object_store_read.py"]


@pytest.mark.parametrize("name", SCRATCH)
def test_a_scratch_dir_that_is_not_one_is_named(run_main, name, tmp_path):
    """``--dir`` went to ``tempfile.mkdtemp`` after the samples were made: a FileNotFoundError traceback."""
    missing, a_file = tmp_path / "nope", tmp_path / "file"
    a_file.write_text("")
    code, err, _out = run_main(name, "--dir", str(missing))
    assert code == 2 and f"argument --dir: {missing}: no such directory" in err, err[-800:]
    code, err, _out = run_main(name, "--dir", str(a_file))
    assert code == 2 and f"argument --dir: {a_file}: not a directory" in err, err[-800:]


@pytest.fixture
def not_a_folder(tmp_path) -> Path:
    """An --out no one can make: below a file."""
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "out"


def test_gpu_check_refuses_an_out_it_cannot_make_before_the_check(run_main, not_a_folder):
    """The folder was made after every section had run: the report was lost to a NotADirectoryError."""
    code, err, _out = run_main("gpu_check.py", "--dry-run", "--out", str(not_a_folder))
    assert code == 2
    assert f"gpu_check.py: error: --out {not_a_folder}: Not a directory" in err


def test_serve_fp8_names_the_out_and_the_missing_checkpoint(run_main, not_a_folder, tmp_path):
    code, err, _out = run_main("serve_fp8.py", "--out", str(not_a_folder), "--workdir", str(tmp_path))
    assert code == 2 and f"serve_fp8.py: error: --out {not_a_folder}: Not a directory" in err, err[-800:]
    code, err, _out = run_main("serve_fp8.py", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path))
    assert code == 2, err[-800:]
    assert f"serve_fp8.py: error: {tmp_path / 'train'}: no checkpoint.json" in err and "Traceback" not in err


def test_serve_throughput_refuses_before_the_servers_start(run_main, not_a_folder, tmp_path):
    recipe = ["--recipe", str(ROOT / "recipes" / "toy.yaml")]
    code, err, _out = run_main("serve_throughput.py", *recipe, "train.num_epoch=3")
    assert code == 2 and "serve_throughput.py: error: train.num_epoch: unknown key" in err, err[-800:]
    code, err, _out = run_main("serve_throughput.py", *recipe, f"evaluate.draft={tmp_path / 'no-draft'}")
    assert code == 2 and f"error: {tmp_path / 'no-draft'}: no exported draft" in err, err[-800:]
    code, err, _out = run_main("serve_throughput.py", *recipe, "--out", str(not_a_folder), f"evaluate.draft={tmp_path}")
    assert code == 2 and f"serve_throughput.py: error: --out {not_a_folder}: Not a directory" in err, err[-800:]


def test_ingest_benches_name_a_missing_manifest_in_one_line(capsys, tmp_path):
    """``load_prompts`` let the ManifestError out as a traceback, after vLLM had been imported."""
    common = load("ingest_common.py")
    args = common.add_args(argparse.ArgumentParser()).parse_args(["--manifest", str(tmp_path / "m.yaml")])
    with pytest.raises(SystemExit) as exit_:
        common.load_prompts(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'm.yaml'}: file not found\n"


def test_blob_layout_check_fails_when_blob_writes_are_slower(capsys):
    """bench/README.md gives it a threshold (blob >= inline) under "--check exits 1 if missed"; it had
    no --check at all."""
    bench = load("featurestore_blob_layout.py")
    slower = {"inline": [1.0, 1.0, 1.0], "blob": [2.0, 2.0, 0.5]}  # blob speed / inline speed 0.5, 0.5, 2
    assert bench.report(slower, check=True) == 1
    assert "FAIL: blob writes are slower than inline" in capsys.readouterr().err
    assert bench.report(slower, check=False) == 0
    assert bench.report({"inline": [2.0, 2.0], "blob": [1.0, 3.0]}, check=True) == 0  # median 1.33


def test_results_file_cut_short_by_a_kill_is_resumed(tmp_path, capsys):
    """learning_curves.py / families.py append one JSON row per measured point (minutes each). A kill
    while appending left a torn last line: every re-run died on ``json.loads``, and an append after it
    would have glued the next row onto the torn one."""
    bench = load("learning_curves.py")
    path = tmp_path / "learning_curves.jsonl"
    row = {"variant": "default", "epochs": 2, "served_al": 1.5}
    path.write_text(json.dumps(row) + "\n" + '{"variant": "default", "epo')
    assert bench.load_rows(path) == [row]
    assert path.read_text() == json.dumps(row) + "\n"  # the torn tail is cut: the next append starts a line
    assert "cut short" in capsys.readouterr().err
    path.write_text(json.dumps(row) + "\n\nnot json\n" + json.dumps(row) + "\n")
    with pytest.raises(SystemExit) as exit_:
        bench.load_rows(path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {path}: line 3 is not a JSON row; mend or delete it\n"
    assert bench.load_rows(tmp_path / "none.jsonl") == []


HELP_OPTION = "  -"


def undocumented_options(help_text: str) -> list[str]:
    """The options of an argparse ``--help`` listed without a help text (on their line or the next)."""
    lines = help_text.splitlines()
    missing = []
    for i, line in enumerate(lines):
        if not line.startswith(HELP_OPTION) or line.startswith("  -h, --help"):
            continue
        invocation, sep, _help = line.strip().partition("  ")
        following = lines[i + 1] if i + 1 < len(lines) else ""
        if not sep and not (following.startswith(" " * 6) and following.strip()):
            missing.append(invocation.split(", ")[-1].split()[0])
    return missing


def test_undocumented_options_are_found():
    text = ("options:\n  -h, --help  show\n  --rounds ROUNDS\n  --samples SAMPLES  samples\n"
            "  --long-name-option LONG_NAME_OPTION\n                        what it does\n  --cold\n")
    assert undocumented_options(text) == ["--rounds", "--cold"]


HELPERS = {"arms.py", "ingest_common.py"}


@pytest.mark.parametrize("name", sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS))
def test_help_says_what_each_flag_does(run_main, name):
    code, _err, text = run_main(name, "--help")
    assert code == 0
    assert text.startswith("usage:")
    assert not undocumented_options(text), f"{name} --help lists {undocumented_options(text)} without saying what"


def test_sigterm_removes_the_scratch_data(tmp_path):
    """A bench killed with SIGTERM (``kill``, a job's time limit) left its scratch directory, a GiB or
    more of features per run under --dir: only Ctrl-C ran the ``finally`` that removes it."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, str(BENCH / "featurestore_write.py"), "--samples", "2", "--min-tokens",
                             "8", "--max-tokens", "8", "--hidden", "8", "--rounds", "1000000", "--dir", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            roots = list(tmp_path.glob("fs_write_bench_*"))
            if roots and not (roots[0] / "warmup").exists():  # imports done: the timed rounds run
                break
            time.sleep(0.1)
        assert proc.poll() is None and roots, "the bench did not reach its rounds"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.iterdir()) == [], "the scratch data was left behind"
    assert proc.returncode == -signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines() == ["featurestore_write.py: terminated"]


def test_cli_startup_names_a_base_revision_that_does_not_exist(monkeypatch, capsys):
    """``git worktree add`` failed on it with a CalledProcessError traceback."""
    import subprocess

    bench = load("cli_startup.py")
    real_run, calls = subprocess.run, []

    def run(cmd, *args, **kwargs):  # rev-parse reads the repository; anything else is recorded, not run
        if "rev-parse" in cmd:
            return real_run(cmd, *args, **kwargs)
        calls.append(cmd)
        raise AssertionError(f"ran {cmd}")

    monkeypatch.setattr(bench.subprocess, "run", run)
    monkeypatch.setattr(sys, "argv", ["cli_startup.py"])  # argparse's prog
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--base", "no-such-revision-anywhere"])
    assert exit_.value.code == 2
    assert ("cli_startup.py: error: --base no-such-revision-anywhere: not a revision of this repository"
            in capsys.readouterr().err)
    assert calls == []


def test_the_arms_get_the_target_the_caller_named_from_any_folder(run_main, tmp_path):
    # The arms run at the repository root: `--target model` relative to the caller's folder was looked up
    # there (and the default from another folder failed), inside each arm's engine.
    arms = load("arms.py")
    ap = argparse.ArgumentParser(prog="x")
    mine = tmp_path / "model"  # run_main made tmp_path the working folder
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    assert arms.target_path(ap, "model") == str(mine.resolve())
    assert arms.target_path(ap, "assets/tiny-target") == str((arms.ROOT / "assets" / "tiny-target").resolve())
