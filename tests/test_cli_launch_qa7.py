"""`train launch` given a recipe it cannot hand to its ranks (QA pass 7). `train run --recipe <(cmd)` reads
the pipe; `train launch` read it too, then started torchrun, whose every rank read `--recipe /dev/fd/63`
again: 'train: error: /dev/fd/63: file not found' from each rank, and torchrun's own error line. Now it is
refused before torchrun starts. No engine, no torchrun."""

from __future__ import annotations

import os
import time
from pathlib import Path

from eaglenest.pipeline import train_cli

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "toy.yaml"


def test_a_recipe_from_a_pipe_is_refused_before_torchrun_starts(tmp_path, capsys):
    r, w = os.pipe()
    os.write(w, RECIPE.read_bytes())
    os.close(w)
    piped = f"/dev/fd/{r}"
    try:
        t0 = time.monotonic()
        code = train_cli.main(["launch", "--nproc", "1", "--recipe", piped, f"run.workdir={tmp_path / 'work'}"])
    finally:
        os.close(r)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"train: error: --recipe {piped}: not a regular file (a pipe or process "
                                 "substitution?): the ranks `train launch` starts each read the recipe again; "
                                 "give a recipe file"], err
    assert time.monotonic() - t0 < 20 and not (tmp_path / "work").exists()


def test_a_recipe_file_still_launches_as_before(tmp_path):
    train_cli.check_recipe_file(str(RECIPE))  # passes: a regular file
    train_cli.check_recipe_file(None)  # the default recipe, read by every rank from the same directory
    link = tmp_path / "recipe.yaml"
    link.symlink_to(RECIPE)
    train_cli.check_recipe_file(str(link))  # a link to a file is a file
