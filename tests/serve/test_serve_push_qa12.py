"""``serve push`` sends the export and nothing else: a file dropped into the draft folder after the export
(notes, a log, a link to a secret elsewhere) is refused in one line before the Hub, not published; and a
repo id the push would refuse is refused by the recipe, so ``--dry-run`` says so (no network either way)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.recipe import load_recipe
from eaglenest.serve.push import plan_push


def _copy(toy_export, tmp_path):
    draft = tmp_path / "my draft"  # a path with a space, as a user's may be
    shutil.copytree(toy_export, draft)
    return draft


def test_an_intact_export_pushes_exactly_its_files(toy_export, tmp_path):
    draft = _copy(toy_export, tmp_path)
    (draft / ".DS_Store").write_text("finder")  # hidden: never pushed, not in the way
    plan = plan_push(draft, repo_id="me/draft", licences={"a": "mit"})
    assert sorted(plan.files) == sorted({"config.json", "model.safetensors", "provenance.json", "README.md"})


@pytest.mark.parametrize("junk", ["notes.txt", "nohup.out", "secret-link"])
def test_a_file_that_is_not_the_exports_is_refused_before_the_hub(toy_export, tmp_path, junk):
    draft = _copy(toy_export, tmp_path)
    if junk == "secret-link":  # a link to a file outside the folder: its content would be published
        (tmp_path / "token").write_text("hf_secret")
        os.symlink(tmp_path / "token", draft / junk)
    else:
        (draft / junk).write_text("scratch")
    with pytest.raises(EaglenestError, match=f"{junk}.*not part of the export") as err:
        plan_push(draft, repo_id="me/draft", licences={"a": "mit"})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("repo_id", ["bad id/x", "me//draft", "me/dr--aft", "a/b/c"])
def test_an_invalid_repo_id_is_refused_by_the_recipe(root, repo_id):
    with pytest.raises(ConfigError, match="serve.hub_repo_id"):
        load_recipe(str(root / "recipes/toy.yaml"), [f"serve.hub_repo_id={repo_id}"])


def test_a_valid_repo_id_and_none_load(root):
    assert load_recipe(str(root / "recipes/toy.yaml"), ["serve.hub_repo_id=me/my.draft-1"]).serve.hub_repo_id
    assert load_recipe(str(root / "recipes/toy.yaml"), []).serve.hub_repo_id == ""  # push itself asks for one


def test_push_dry_run_refuses_an_invalid_repo_id(root):
    proc = subprocess.run([sys.executable, "-m", "eaglenest.serve.cli", "push", "--dry-run",
                           "--recipe", str(root / "recipes/toy.yaml"), "serve.hub_repo_id=bad id//x"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-500:]
    assert proc.stderr.count("\n") == 1 and "serve.hub_repo_id" in proc.stderr


def test_push_sends_what_export_writes():
    from eaglenest.serve.export import EXPORT_FILES
    from eaglenest.serve.push import PUSHED_FILES

    assert PUSHED_FILES == EXPORT_FILES


def test_head_is_no_branch_name(root):
    """``git check-ref-format --branch HEAD`` refuses it (git branch HEAD too): the Hub's repo would be
    created first and the push then fail on the branch."""
    from eaglenest.serve.config import is_branch_name

    assert not is_branch_name("HEAD")
    assert is_branch_name("HEAD-2") and is_branch_name("x/HEAD") and is_branch_name("head")
    with pytest.raises(ConfigError, match="serve.hub_revision"):
        load_recipe(str(root / "recipes/toy.yaml"), ["serve.hub_revision=HEAD"])
