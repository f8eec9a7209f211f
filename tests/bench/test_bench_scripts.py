"""The bench scripts still run: every ``--help``, the options their docstrings show, and the fixes
for the benches that had rotted (bench/ is not a package: each script is loaded from its file)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
HELPERS = {"arms.py", "ingest_common.py"}  # loaded by the benches, not run
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
OPTION = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")


def load(name: str):
    return load_bench(name, "_bench")


def example_options(name: str) -> set[str]:
    """Options on the docstring's example command lines (``... bench/<name> ...`` and their continuations)."""
    doc = ast.get_docstring(ast.parse((BENCH / name).read_text())) or ""
    found, command = set(), False
    for line in doc.splitlines():
        if f"bench/{name}" in line:
            command = True
        elif not line.startswith(" ") or not line.strip():
            command = False
        if command:
            found |= set(OPTION.findall(line.split("#")[0]))
    return found - {"--nproc-per-node"}  # torchrun's own


def readme_options(name: str) -> set[str]:
    """Options on bench/README.md's command lines for ``name``."""
    lines = (BENCH / "README.md").read_text().splitlines()
    return {o for line in lines if f"bench/{name}" in line for o in OPTION.findall(line.split("#")[0])}


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20 and "featurestore_write.py" in SCRIPTS and "arms.py" not in SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_runs_and_knows_the_docstring_examples(name):
    proc = subprocess.run([sys.executable, str(BENCH / name), "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, f"{name} --help: {proc.stderr[-2000:]}"
    assert proc.stdout.startswith("usage:"), f"{name} --help printed no usage"
    known = set(OPTION.findall(proc.stdout))
    unknown = sorted(example_options(name) - known)
    assert not unknown, f"{name}: its docstring's examples use {unknown}, which its argparse does not define"
    unknown = sorted(readme_options(name) - known)
    assert not unknown, f"bench/README.md runs {name} with {unknown}, which its argparse does not define"


def test_example_options_are_read_from_the_docstring():
    # the helper the test above relies on sees options on continuation lines, not prose
    assert {"--frames", "--train-tokens-per-s", "--dtype"} <= example_options("stream_transport.py")
    assert "--check" in example_options("featurestore_write.py")
    assert {"--ttt-repeats", "--long", "--chunk"} <= readme_options("train_throughput.py")


def test_serve_throughput_prints_a_level_without_a_speed_up():
    """run_sweep reports ``None`` for a level whose baseline produced no tokens; the bench printed
    its summary with ``s['median']`` and crashed after the whole sweep had run."""
    bench = load("serve_throughput.py")
    lines = bench.speedup_lines([
        {"concurrency": 1, "speedup": 1.5, "speedup_per_seed": {"median": 1.4, "min": 1.2, "max": 1.6}},
        {"concurrency": 4, "speedup": None, "speedup_per_seed": None}])
    assert lines[1] == "  concurrency   1: 1.400 [1.200, 1.600]  (ratio of means 1.500)"
    assert lines[2] == "  concurrency   4: -  (ratio of means -)"


def test_cli_startup_stops_on_a_help_that_fails():
    """A ``--help`` that fails at import is fast: timed, it read as a speed-up of whichever side broke."""
    bench = load("cli_startup.py")
    with pytest.raises(SystemExit) as err:
        bench.one_run("eaglenest.no_such_cli", None)
    assert "eaglenest.no_such_cli --help failed" in str(err.value)
    assert "this checkout" in str(err.value) and "No module named" in str(err.value)


@pytest.mark.slow
def test_ingest_dask_runs_with_one_worker(tmp_path):
    """The warm-up shard went to a store folder no one had made, and the workers' check (the store must
    be visible on every worker) refused it: the bench died before its first round."""
    proc = subprocess.run([sys.executable, str(BENCH / "ingest_dask.py"), "--prompts", "2", "--rounds", "1",
                           "--max-tokens", "8", "--max-num-seqs", "2", "--workers", "1", "--commit-every", "1",
                           "--store", str(tmp_path / "stores")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dask/inprocess = " in proc.stdout


def test_cli_startup_refuses_fewer_than_two_runs_before_any_work(monkeypatch, capsys):
    """``--runs 1`` ran every CLI, then died in ``statistics.quantiles`` (it needs two data points)."""
    bench = load("cli_startup.py")
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **kw: calls.append(a))  # no git worktree here
    monkeypatch.setattr(bench, "link_farm", lambda checkout, dest: dest)
    monkeypatch.setattr(bench, "one_run", lambda module, path: 0.1)
    with pytest.raises(SystemExit) as err:
        bench.main(["--base", "HEAD", "--runs", "1"])
    assert err.value.code == 2
    assert "--runs: at least 2, got 1" in capsys.readouterr().err
    assert calls == []


def test_query_memory_refuses_a_size_below_one_sample(capsys):
    """``--sizes 2,8`` at 4 MiB per sample built no table at size 2; the query then failed on a store
    that did not exist, reported as ``query failed (exit 0)``."""
    bench = load("featurestore_query_memory.py")
    with pytest.raises(SystemExit) as err:
        bench.main(["--sizes", "2,8", "--rounds", "1"])
    assert err.value.code == 2
    assert "--sizes: each size must be at least --row-mib (4 MiB), got 2,8" in capsys.readouterr().err


def test_query_memory_reports_the_query_commands_exit_code(tmp_path):
    """The child exits 0 after printing the command's code: a failed query read as ``exit 0``."""
    bench = load("featurestore_query_memory.py")
    with pytest.raises(SystemExit) as err:
        bench.peak_growth(str(tmp_path / "no-store"), tmp_path / "out.parquet")
    assert str(err.value).startswith("query failed (exit 2): ")
    assert "no-store" in str(err.value)


def test_families_keeps_a_throughput_point_without_a_speed_up(tmp_path, monkeypatch):
    """``evaluate throughput`` reports ``speedup: null`` when the baseline produced no tokens; the bench
    rounded it and crashed after both servers had run, keeping nothing."""
    import json
    from types import SimpleNamespace

    # families.py imports learning_curves from beside it (by putting bench/ on sys.path): hand it the module
    monkeypatch.setitem(sys.modules, "learning_curves", load("learning_curves.py"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # and puts bench/ first on a copy, dropped after
    bench = load("families.py")
    result = {"modes": {"baseline": [{"output_tokens_per_s": {"mean": 0.0}}],
                        "speculative": [{"output_tokens_per_s": {"mean": 12.34}}]},
              "speedup": [{"concurrency": 1, "speedup": None, "speedup_per_seed": None}],
              "arms": {"all_identical": True}}

    def fake_run(cmd, log):  # evaluate throughput, as far as the bench reads it
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "throughput.json").write_text(json.dumps(result))
        return 0.0

    monkeypatch.setattr(bench, "_run", fake_run)
    args = SimpleNamespace(recipe="recipes/toy.yaml", tput_prompts=4, extra=[])
    row = bench.throughput_point(args, tmp_path, "eagle3", 1, 3, tmp_path / "log.txt")
    assert row["speedup"] is None and row["tokens_per_s"] == 12.3 and row["target_alone_tokens_per_s"] == 0.0
    curve = {"kind": "curve", "family": "eagle3", "epochs": 1, "k": 3, "steps": 5, "served_al": 1.5,
             "acceptance_by_position": [0.5], "forwards_per_round": 3, "ngram_al": None, "lossless": "3/3"}
    line = next(x for x in bench.tables([curve, row], ["eagle3"], 1).splitlines() if x.startswith("| eagle3 | 5 "))
    assert "| 12.3 (0.0) | - | - | 3/3 |" in line


ROUNDS = [n for n in SCRIPTS if "--rounds" in (BENCH / n).read_text() and n != "featurestore_write.py"]


@pytest.mark.parametrize("name", ROUNDS)
def test_zero_rounds_are_refused_before_any_work(name):
    # `--rounds 0` ran the whole setup, then crashed at the end on an empty list of ratios (median of nothing).
    # (featurestore_write.py takes 0 on purpose: its --rss run alone.)
    proc = subprocess.run([sys.executable, str(BENCH / name), "--rounds", "0"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "argument --rounds: must be >= 1, got 0" in proc.stderr, (name, proc.stderr[-800:])


def test_rounds_of_ingest_benches_are_checked_too():
    assert {"ingest_regen.py", "ingest_capture.py", "featurestore_read.py"} <= set(ROUNDS)
