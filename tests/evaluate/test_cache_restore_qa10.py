"""`evaluate al` on a folder whose report.json already measures the draft (hostile pass 10).

A report.md or a plot removed by hand stayed missing: the cached run printed the Markdown and wrote
nothing, so the folder kept a report.json without the files it is documented to come with. They are
written again from report.json (nothing measured, report.json untouched). And report.md's prompt-mode
table lacked the per-mode target_confidence / ngram_al that report.json holds for each mode."""

from __future__ import annotations

import pytest

from eaglenest.evaluate import commands
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.report import markdown, write_report
from eaglenest.evaluate.settings import evaluate_config
from eaglenest.recipe import load_recipe


def _row(prompts: int, al: float, conf: float | None = None, ngram: float | None = None) -> dict:
    row = {"prompts": prompts, "acceptance_length": al, "acceptance_length_per_request": al,
           "acceptance_rate": round((al - 1) / 2, 4), "acceptance_by_position": [0.5, 0.25]}
    if conf is not None:
        row.update(target_confidence=conf, ngram_al=ngram)
    return row


def _report(buckets: bool) -> dict:
    return {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 2,
            "al_average": "pooled", "domains": {"g": _row(3, 1.75, 0.8125, 1.25)}, "overall": _row(3, 1.75),
            "modes": {"chat": _row(2, 1.5, 0.6875, 1.125), "raw": _row(1, 2.25, 0.9375, 1.5)},
            "predictability": {"measure": "m", "ngram": {"measure": "n"}},
            "context_buckets": {"1024": {**_row(1, 1.5), "prompt_tokens": 1024}} if buckets else {}}


@pytest.fixture
def measured(tmp_path, root, tiny_target):
    """A folder as a finished `evaluate al` run left it (report.json under this run's key, report.md, plots):
    returns (run the command, the folder, the report)."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    argv = [f"run.workdir={tmp_path / 'work'}", f"run.target={tiny_target}", f"evaluate.draft={draft}",
            "evaluate.num_speculative_tokens=2", "evaluate.chat_template_kwargs={}"]
    recipe = load_recipe(root / "recipes" / "toy.yaml", argv)

    def made(buckets: bool):
        report = {**_report(buckets), "cache_key": commands._cache_key(recipe, str(draft), evaluate_config(recipe))}
        out = tmp_path / "work" / "eval"
        write_report(out, report)
        return (lambda: evaluate_main(["al", f"--recipe={root / 'recipes' / 'toy.yaml'}", *argv])), out, report

    return made


@pytest.mark.parametrize("buckets", [False, True])
@pytest.mark.parametrize("gone", ["report.md", "al_by_domain.png", "acceptance_by_position.png", "al_by_context.png"])
def test_a_cached_run_writes_again_what_was_removed(measured, capsys, buckets, gone):
    run, out, report = measured(buckets)
    if gone == "al_by_context.png" and not buckets:
        assert not (out / gone).exists()  # a report without buckets draws none: nothing to restore
    else:
        (out / gone).unlink()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != gone}
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != gone}
    assert run() == 0
    captured = capsys.readouterr()
    assert "already measures this draft" in captured.err  # not measured again
    assert captured.out == markdown(report) + "\n"  # print()ed
    assert (out / "report.md").read_text() == markdown(report)
    plots = {"al_by_domain.png", "acceptance_by_position.png"} | ({"al_by_context.png"} if buckets else set())
    assert plots <= {p.name for p in out.iterdir()}
    assert (out / "al_by_context.png").exists() == buckets
    assert (out / "report.json").read_bytes() == before["report.json"]
    assert (out / "report.json").stat().st_mtime_ns == mtimes["report.json"]
    # what was in place stays as it was: report.md when a plot is missing (the plots are drawn together), the
    # plots when report.md alone is
    kept = [n for n in mtimes if (n.endswith(".png") if gone == "report.md" else n == "report.md")]
    assert kept and all((out / n).stat().st_mtime_ns == mtimes[n] for n in kept), kept
    restored = f"{out / gone} was missing: written again from report.json" in captured.err
    assert restored == (gone != "al_by_context.png" or buckets)


def test_a_cached_run_with_every_file_in_place_writes_nothing(measured, capsys):
    run, out, _ = measured(True)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert run() == 0
    assert "was missing" not in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_the_mode_table_has_each_modes_target_confidence_and_ngram_al():
    lines = markdown(_report(False)).splitlines()
    head = lines.index(next(ln for ln in lines if ln.startswith("## By prompt mode")))
    table = [ln for ln in lines[head:] if ln.startswith("| ")]
    assert table[0].startswith("| mode | target_confidence | ngram_al | prompts | AL pooled |")
    assert table[1] == "| chat | 0.688 | 1.125 | 2 | 1.500 | 1.500 | 0.250 | 0.500 | 0.250 |"
    assert table[2] == "| raw | 0.938 | 1.500 | 1 | 2.250 | 2.250 | 0.625 | 0.500 | 0.250 |"
