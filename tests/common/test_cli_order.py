"""Options may come before or after ``section.key=value`` overrides (issue 12)."""

from __future__ import annotations

import json

import pytest


def test_options_after_overrides(capsys):
    from eaglenest.evaluate.cli import main

    assert main(["al", "evaluate.ngram_order=0", "--dry-run", "evaluate.max_tokens=7", "--recipe",
                 "recipes/toy.yaml", "--out", "/nonexistent/never-written", "evaluate.max_tokens=9"]) == 0
    cfg = json.loads(capsys.readouterr().out)["evaluate"]
    assert cfg["ngram_order"] == 0 and cfg["max_tokens"] == 9  # later overrides win, in command-line order


@pytest.mark.parametrize("extra", [["--bogus"], ["x=1", "--dry-run", "junk"]])
def test_unknown_arguments_still_refused(extra, capsys):
    from eaglenest.evaluate.cli import main

    with pytest.raises(SystemExit) as e:
        main(["al", "--dry-run", "--out", "/tmp/x", *extra])
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
