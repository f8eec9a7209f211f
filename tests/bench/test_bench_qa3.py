"""QA pass 3 on the bench scripts: numbers a rate, a size or a pause cannot be are usage errors before
any work (they were a traceback at the end of the run, or a child process's), not a run on nothing.

Each script's ``main`` runs in this process; the refusals come from argparse, so nothing is measured.
bench/ is not a package: scripts are loaded from their files.
"""

from __future__ import annotations

import sys

import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest


def load(name: str):
    return load_bench(name, "_bench_qa3")


# Before the fix: featurestore_read divided by --rank-tokens-per-s after the whole run (ZeroDivisionError);
# stream_memory's consumer slept a negative time after the engine had started (ValueError); featurestore_write's
# --rss child wrote nothing for --rss-gb 0 and then failed to open the table it never made; a budget of 0 MiB
# or less reached the FeatureWriter; stream_transport printed the bandwidth of a negative rate.
BAD_NUMBERS = [
    ("featurestore_read.py", ["--rank-tokens-per-s", "0"],
     "argument --rank-tokens-per-s: must be a number > 0, got '0'"),
    ("featurestore_read.py", ["--rss-gb", "-1"], "argument --rss-gb: must be a number > 0, got '-1'"),
    ("featurestore_write.py", ["--rss-gb", "0"], "argument --rss-gb: must be a number > 0, got '0'"),
    ("featurestore_write.py", ["--rss-gb", "nan"], "argument --rss-gb: must be a number > 0, got 'nan'"),
    ("featurestore_write.py", ["--rss-gb", "inf"], "argument --rss-gb: must be a number > 0, got 'inf'"),
    ("featurestore_write.py", ["--rss-budget-mb", "0"], "argument --rss-budget-mb: must be >= 1, got 0"),
    ("stream_memory.py", ["--sleep-s", "-1"], "argument --sleep-s: must be a number >= 0, got '-1'"),
    ("stream_transport.py", ["--train-tokens-per-s", "-5"],
     "argument --train-tokens-per-s: must be a number > 0, got '-5'"),
]


#: Sizes that keep a script that failed to refuse short (seconds, not minutes).
SMALL = {
    "featurestore_read.py": ["--samples", "1", "--min-tokens", "8", "--max-tokens", "8", "--hidden", "8",
                             "--h7168-samples", "1", "--rounds", "1"],
    "featurestore_write.py": ["--samples", "1", "--min-tokens", "8", "--max-tokens", "8", "--hidden", "8",
                              "--rounds", "0", "--rss"],
    "stream_memory.py": ["--samples", "1", "--tokens", "8", "--depths", "1"],
    "stream_transport.py": ["--frames", "2", "--tokens", "8", "--layers", "1", "--hidden", "8", "--rounds", "1"],
}


@pytest.mark.parametrize("name, args, line", BAD_NUMBERS,
                         ids=[f"{name[:-3]}{'_'.join(args)}" for name, args, _line in BAD_NUMBERS])
def test_a_number_no_run_can_use_is_one_usage_line_before_any_work(monkeypatch, capsys, name, args, line):
    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = load(name)
    monkeypatch.setattr(sys, "argv", [name, *SMALL[name], *args])
    with pytest.raises(SystemExit) as exit_:
        mod.main()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err[-800:]
    assert err.strip().splitlines()[-1] == f"{name}: error: {line}"
    assert out == ""  # no sizes, no round lines: nothing ran


@pytest.mark.parametrize("name", ["learning_curves.py", "families.py"])
def test_a_workdir_that_does_not_exist_is_one_usage_line_and_is_not_made(monkeypatch, capsys, tmp_path, name):
    # It was made (lc/, fam/, a log), then `train run` failed on the store that was not there: exit 1,
    # "see <workdir>/lc/log.txt", and a new run folder left at the mistyped path.
    monkeypatch.setattr(sys, "path", list(sys.path))
    curves = load("learning_curves.py")
    monkeypatch.setitem(sys.modules, "learning_curves", curves)
    mod = load(name)
    workdir = tmp_path / "runs" / "tyop"
    monkeypatch.setattr(sys, "argv", [name, "--workdir", str(workdir), "--epochs", "1"])
    for m in {curves, mod}:
        monkeypatch.setattr(m, "_run", lambda *a, **k: pytest.fail("a command was run"))
    with pytest.raises(SystemExit) as exit_:
        mod.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err[-800:]
    assert err.strip().splitlines()[-1] == (f"{name}: error: --workdir {workdir}: no such folder "
                                            "(run `make demo` first, or give the run folder of the demo's store)")
    assert not (tmp_path / "runs").exists()
