"""QA pass 9 at the CLI surface: a mistyped verb or option is one line (README: "Bad input exits with code 2
and one line naming the problem") that names the closest real one, exit 2, nothing written. Before: argparse's
usage block (two to four lines) and its error, with no suggestion (`evaluate alx`, `evaluate al --forse`)."""

from __future__ import annotations

import pytest

from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.serve.cli import main as serve_main


def _refused(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize("main, prog, typed, meant", [
    (evaluate_main, "evaluate", "alx", "al"),
    (evaluate_main, "evaluate", "offlne", "offline"),
    (train_main, "train", "rn", "run"),
    (serve_main, "serve", "exprt", "export"),
    (ingest_main, "ingest", "biuld", "build"),
    (featurestore_main, "featurestore", "captur", "capture"),
])
def test_a_mistyped_verb_is_one_line_naming_the_closest(capsys, main, prog, typed, meant):
    line = _refused(capsys, main, [typed, "--dry-run"])
    assert line.startswith(f"{prog}: error: ") and repr(typed) in line, line
    assert line.endswith(f"; did you mean {meant}?"), line


def test_a_verb_nothing_like_any_is_one_line_without_a_guess(capsys):
    line = _refused(capsys, evaluate_main, ["zzzzzz"])
    assert line.startswith("evaluate: error: ") and "'zzzzzz'" in line and "did you mean" not in line, line


@pytest.mark.parametrize("argv, meant", [
    (["al", "--forse", "--dry-run"], "--force"),
    (["al", "--dry-run", "evaluate.max_tokens=3", "--maniefst", "m.yaml"], "--manifest"),
    (["offline", "--darft=d", "--dry-run"], "--draft"),
    (["parity", "--dry-run", "--chekpoint", "c"], "--checkpoint"),
])
def test_a_mistyped_option_is_one_line_naming_the_closest_option_of_that_verb(capsys, tmp_path, monkeypatch,
                                                                              argv, meant):
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, evaluate_main, argv)
    assert line.startswith("evaluate: error: unrecognized arguments: "), line
    assert line.endswith(f"; did you mean {meant}?"), line
    assert list(tmp_path.iterdir()) == []


def test_an_option_error_of_a_verb_is_one_line_too(capsys):
    # argparse printed the verb's three-line usage first
    line = _refused(capsys, evaluate_main, ["al", "--recipe"])
    assert line == "evaluate al: error: argument --recipe: expected one argument", line


def test_help_still_prints_the_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        evaluate_main(["al", "--help"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: evaluate al") and "--force" in out


@pytest.mark.parametrize("argv", [
    ["al", "--out", ""], ["al", "--manifest", " "], ["throughput", "--out", ""], ["offline", "--draft", ""],
    ["offline", "--out", ""], ["parity", "--checkpoint", ""], ["compare", "--a", "", "--b", "x"],
    ["compare", "--a", "x", "--b", "", "--out", "y"],
])
def test_an_empty_path_option_of_evaluate_is_refused_not_read_as_its_default(capsys, tmp_path, monkeypatch, argv):
    # `--out "$DIR"` with DIR unset: the run went to <workdir>/eval (replacing that report) or, for --a / --b,
    # compared the current directory; --draft "" and --checkpoint "" fell back to the recipe's.
    monkeypatch.chdir(tmp_path)
    flag = next(a for a, v in zip(argv, argv[1:]) if a.startswith("--") and not v.strip())
    line = _refused(capsys, evaluate_main, [*argv, "--dry-run", f"run.workdir={tmp_path / 'w'}"])
    assert line == f"evaluate {argv[0]}: error: argument {flag}: empty path", line
    assert list(tmp_path.iterdir()) == []
