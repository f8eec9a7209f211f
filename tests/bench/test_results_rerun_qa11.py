"""Re-runs of the benches that keep their rows in a results file (learning_curves.py, families.py):
a re-run skips the points already measured, so what a row was measured with (the recipe, the
overrides) must match the run that reuses it, and a ratio "vs the first variant" must divide by
the variant named first on this command line, not by whichever row the file happens to hold first.

No point is measured here except where the test expects one to be tried: a recipe that does not
exist makes ``train run`` fail at once, and the bench stops naming the command.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

ROW = {"steps": 36, "train_seconds": 100.0, "acceptance_by_position": [0.5, 0.3, 0.1], "lossless": "87/87",
       "prompts": 87}


def load(name: str):
    return load_bench(name, "_bench_qa11")


@pytest.fixture
def run(monkeypatch, capsys, tmp_path):
    """``run(script, *args)``: (exit code or None, stdout, stderr) of the script's ``main``."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)

    def go(name: str, *args: str):
        if name == "families.py":
            monkeypatch.setitem(sys.modules, "learning_curves", load("learning_curves.py"))
        mod = load(name)
        monkeypatch.setattr(sys, "argv", [name, *args])
        try:
            code = mod.main()
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return go


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def vs_first(out: str) -> dict[str, float]:
    """variant -> the table's "vs first" column."""
    cells = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    head = [c.strip() for c in cells[0]]
    return {c[0].strip(): float(c[head.index("vs first")]) for c in cells[1:]}


def test_vs_first_divides_by_the_variant_named_first(run, tmp_path):
    """The file holds random_init's row before default's (an earlier run measured it first); this run
    names default first. Before the fix the column divided by random_init: default read 2.000x."""
    rand = ["train.init_lm_head=random", "train.init_norm=ones"]
    write_rows(tmp_path / "learning_curves.jsonl",
               [{"variant": "random_init", "overrides": rand, "epochs": 2, "served_al": 1.5, **ROW},
                {"variant": "default", "overrides": [], "epochs": 2, "served_al": 3.0, **ROW}])
    code, out, _ = run("learning_curves.py", "--workdir", str(tmp_path), "--epochs", "2",
                       "--variant", "default=", "--variant", "random_init=" + ",".join(rand))
    assert code == 0
    assert vs_first(out) == {"default": 1.0, "random_init": 0.5}


def test_a_row_of_other_overrides_under_the_same_name_is_not_in_the_table(run, tmp_path):
    """An older row named ``default`` with other overrides is not this run's default: before the fix both
    rows were printed, and the ratio's base was whichever came first in the file."""
    write_rows(tmp_path / "learning_curves.jsonl",
               [{"variant": "default", "overrides": ["train.lr=1"], "epochs": 2, "served_al": 9.0, **ROW},
                {"variant": "default", "overrides": [], "epochs": 2, "served_al": 3.0, **ROW},
                {"variant": "half", "overrides": ["train.lr=2"], "epochs": 2, "served_al": 1.5, **ROW}])
    code, out, _ = run("learning_curves.py", "--workdir", str(tmp_path), "--epochs", "2",
                       "--variant", "default=", "--variant", "half=train.lr=2")
    assert code == 0
    assert vs_first(out) == {"default": 1.0, "half": 0.5}
    assert "9.000" not in out


def test_learning_curves_does_not_reuse_a_row_of_another_recipe(run, tmp_path):
    """A row measured with the default recipe is not a result for ``--recipe other.yaml``: before the fix the
    re-run skipped the point and printed the old recipe's AL as the new one's (exit 0)."""
    write_rows(tmp_path / "learning_curves.jsonl",
               [{"variant": "default", "overrides": [], "epochs": 2, "served_al": 3.0, **ROW}])
    other = tmp_path / "no such recipe.yaml"
    code, out, err = run("learning_curves.py", "--workdir", str(tmp_path), "--epochs", "2", "--recipe", str(other),
                         "--variant", "default=")
    assert code != 0 and "failed" in str(code)  # the point was measured: train run with that recipe, which fails
    assert str(other) in (tmp_path / "lc" / "log.txt").read_text()
    # the default recipe's row (written before rows named their recipe) is still reused by the default recipe
    code, out, _ = run("learning_curves.py", "--workdir", str(tmp_path), "--epochs", "2", "--variant", "default=")
    assert code == 0 and vs_first(out) == {"default": 1.0}


def test_families_does_not_reuse_a_row_of_other_overrides(run, tmp_path):
    """families.py keyed its rows by (kind, family, epochs, K) only: a re-run with other overrides for every
    command (``train.lr=...``) or another ``--recipe`` printed the old rows as its result."""
    curve = {"kind": "curve", "family": "eagle3", "epochs": 1, "k": 3, "variant": "eagle3",
             "overrides": ["train.family=eagle3", "evaluate.num_speculative_tokens=3", "evaluate.ngram_order=3"],
             "served_al": 2.0, "ngram_al": 1.5, "forwards_per_round": 3, "table_version": 1, **ROW}
    write_rows(tmp_path / "families.jsonl", [curve])
    args = ["--workdir", str(tmp_path), "--families", "eagle3", "--epochs", "1", "--curve", "", "--ks", "",
            "--no-throughput"]
    code, out, _ = run("families.py", *args)  # the same run as the row's: nothing to measure
    assert code == 0 and "| eagle3 | 36 | 2.000 |" in out
    code, out, _ = run("families.py", *args, "train.lr=0.5")
    assert code != 0 and "failed" in str(code)
    assert "train.lr=0.5" in (tmp_path / "lc" / "log.txt").read_text()
    code, out, _ = run("families.py", *args, "--recipe", str(tmp_path / "other.yaml"))
    assert code != 0 and "other.yaml" in (tmp_path / "lc" / "log.txt").read_text()


def test_serve_fp8_names_a_workdir_without_a_store_in_one_line(run, tmp_path, toy_checkpoint, tiny_target):
    """A run folder with the draft's checkpoint but no store (trained elsewhere, or the store moved): the
    bench exported the three drafts, then died in a StoreError traceback instead of one line, exit 2."""
    import shutil

    work = tmp_path / "run folder"
    shutil.copytree(toy_checkpoint, work / "train")
    code, out, err = run("serve_fp8.py", "--workdir", str(work), "--out", str(tmp_path / "fp8 out"), "--target",
                         str(tiny_target),
                         "--max-prompts-per-domain", "1", "--max-tokens", "4")
    assert code == 2, err[-800:]
    assert err.strip().splitlines()[-1] == \
        f"serve_fp8.py: error: no prompts table in {work / 'store'}: run `ingest build` first"
    assert err.startswith("usage: serve_fp8.py") and "Traceback" not in err  # argparse's usage, then one line
