"""Overrides and recipes as a demanding user types them (QA pass 12).

- An override of a whole section or nested section (``train={num_epochs: 3}``, ``train.stream={depth: 4}``)
  replaced what the recipe file set there: ``recipes/toy.yaml``'s ``train.sliding_window: auto`` silently
  went back to its default. Hydra and OmegaConf merge a mapping into the node, and a dotted override of the
  same key merges too; now a mapping merges key by key, at any depth (``null`` first to start afresh).
- A misspelt section (``trian.lr=3``) named the known sections but not the one meant, as a misspelt key does.
"""

from __future__ import annotations

import dataclasses

import pytest

from eaglenest.config import apply_overrides
from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe
from eaglenest.train.config import TrainConfig


@pytest.fixture
def toy(root):
    return str(root / "recipes" / "toy.yaml")


def test_a_section_given_as_a_mapping_merges_into_the_recipe(toy):
    base = load_recipe(toy)
    assert base.train.sliding_window == "auto" and base.train.num_epochs == 10  # what toy.yaml sets
    merged = load_recipe(toy, ["train={num_epochs: 3}"])
    assert merged.train.num_epochs == 3
    assert merged.train.sliding_window == "auto"  # kept from the file, as train.num_epochs=3 keeps it
    assert merged.train == load_recipe(toy, ["train.num_epochs=3"]).train


def test_a_nested_mapping_merges_at_every_depth():
    data = {"train": {"stream": {"depth": 2, "addr": "h:1"}, "lr": 0.5}}
    out = apply_overrides(data, ["train={stream: {depth: 4}}", "train.track={run_name: a}", "train.track.dir=t"])
    assert out == {"train": {"stream": {"depth": 4, "addr": "h:1"}, "lr": 0.5, "track": {"run_name": "a", "dir": "t"}}}
    assert data == {"train": {"stream": {"depth": 2, "addr": "h:1"}, "lr": 0.5}}  # the input is left as it was


def test_null_then_a_mapping_starts_the_section_afresh(toy):
    fresh = load_recipe(toy, ["train=null", "train={num_epochs: 3}"])
    # every other key at the dataclass's own default, none of the file's (toy.yaml sets sliding_window: auto)
    assert fresh.train == dataclasses.replace(TrainConfig(), num_epochs=3)
    assert fresh.train.sliding_window == TrainConfig().sliding_window != "auto"


def test_a_scalar_still_replaces_a_section_and_is_refused(toy):
    with pytest.raises(ConfigError, match=r"^train: expected a mapping, got int$"):
        load_recipe(toy, ["train=3"])


@pytest.mark.parametrize("typed,meant", [("trian", "train"), ("evalute", "evaluate"), ("featurestor", "featurestore")])
def test_a_misspelt_section_names_the_closest_one(toy, typed, meant):
    with pytest.raises(ConfigError, match=rf"^{typed}: unknown recipe section .*; did you mean {meant}\?$"):
        load_recipe(toy, [f"{typed}.lr=3"])
