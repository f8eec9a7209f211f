"""README's "Recipes and overrides" as a new user working outside the checkout reads it: without
``--recipe`` every command (``ingest validate`` included) reads ``recipes/toy.yaml`` from the current
directory and refuses in one line naming ``--recipe``; a recipe of one's own holds only what differs,
the rest (``run.workdir``, ``ingest.manifest`` among it) being the demo's defaults. No engine: ``--dry-run``
and a validation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from eaglenest.ingest.cli import main as ingest_main
from eaglenest.ingest.config import IngestConfig
from eaglenest.runconfig import RunConfig

ROOT = Path(__file__).resolve().parent.parent
ROOT_RECIPE = "recipes/toy.yaml"


def test_outside_the_checkout_a_command_without_recipe_names_the_option(tmp_path, monkeypatch, capsys):
    (tmp_path / "manifest.yaml").write_text("name: mine\n")
    monkeypatch.chdir(tmp_path)
    assert ingest_main(["validate", "--manifest", "manifest.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ROOT_RECIPE in err[0] and "--recipe" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.yaml"]  # nothing written


def test_a_recipe_of_ones_own_takes_the_demo_defaults_for_what_it_leaves_out(tmp_path, monkeypatch, capsys):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"run": {"target": "my models/target"}}))
    monkeypatch.chdir(tmp_path)
    assert ingest_main(["build", "--recipe", "recipe.yaml", "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["run"]["target"] == "my models/target"
    # The demo's, as README says (the reference: README's own values, not the code's defaults)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = re.search(r"for `run\.workdir` \(`([^`]+)`\) and `ingest\.manifest`\s+\(`([^`]+)`\) is the demo's", readme)
    assert said, "README no longer says the demo's defaults"
    assert (resolved["run"]["workdir"], resolved["ingest"]["manifest"]) == said.groups() == (
        RunConfig.workdir, IngestConfig.manifest)
