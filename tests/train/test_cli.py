"""The train and serve CLIs: dry run, config errors as exit code 2, end to end on a tiny store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eaglenest.serve.cli import main as serve_main
from eaglenest.pipeline.train_cli import main as train_main

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def test_dry_run_prints_train_section(capsys):
    assert train_main(["run", "--recipe", RECIPE, "--dry-run", "train.ttt_steps=3"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["ttt_steps"] == 3


@pytest.mark.parametrize("override, key", [("train.ttt_steps=0", "train.ttt_steps"),
                                           ("train.nope=1", "train.nope"),
                                           ("serve.dtype=int8", "serve.dtype")])
def test_config_errors_exit_2(capsys, override, key):
    assert train_main(["run", "--recipe", RECIPE, override]) == 2
    assert key in capsys.readouterr().err


def test_sections_and_flat_keys_refused_naming_the_new_key(capsys, tmp_path):
    """train.stream / select / state are sections; every key of the earlier flat layout, in an
    override or in a file, is refused with one line naming its new place (exit code 2)."""
    from eaglenest.train.config import RENAMED, TrainConfig

    assert train_main(["run", "--recipe", RECIPE, "--dry-run", "train.stream.depth=3", "train.state.keep=5",
                       "train.select.split=test"]) == 0
    train = json.loads(capsys.readouterr().out)["train"]
    assert (train["stream"]["depth"], train["state"]["keep"], train["select"]["split"]) == (3, 5, "test")
    for old, new in RENAMED.items():
        section, key = new.split(".")
        assert key in {f.name for f in dataclasses.fields(getattr(TrainConfig(), section))}
        assert train_main(["run", "--recipe", RECIPE, "--dry-run", f"train.{old}=1"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.endswith(f"train.{old}: renamed to train.{new}"), err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("train:\n  stream_depth: 4\n")
    assert train_main(["run", "--recipe", str(recipe), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip().endswith("train.stream_depth: renamed to train.stream.depth")


@pytest.mark.slow
def test_train_then_export(tmp_path, feature_store, tiny_target, capsys):
    uri, version = feature_store
    common = ["--recipe", RECIPE, f"run.workdir={tmp_path}", f"run.target={tiny_target}", f"run.store={uri}"]
    assert train_main(["run", *common, "train.num_steps=2", "train.draft_vocab_size=256",
                       "train.ttt_steps=2", f"train.table_version={version}"]) == 0
    printed = capsys.readouterr().out
    assert serve_main(["export", *common]) == 0
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    # The draft's size is reported by train run and in the model card (the target embeddings excluded).
    from safetensors.torch import load_file

    n = sum(t.numel() for k, t in load_file(str(tmp_path / "draft" / "model.safetensors")).items()
            if t.is_floating_point())
    assert f"{n:,} parameters" in printed
    assert f"| parameters | {n:,} " in (tmp_path / "draft" / "README.md").read_text()
    assert cfg["draft_vocab_size"] == 256 and cfg["torch_dtype"] == "float32"
    prov = json.loads((tmp_path / "train" / "provenance.json").read_text())
    assert prov["inputs"]["version"] == version and prov["config"]["train"]["num_steps"] == 2
    assert serve_main(["export", *common[:2], f"run.workdir={tmp_path / 'empty'}",
                       f"run.target={tiny_target}"]) == 2
