"""Dotted overrides a user gets wrong: one given twice, one without its section (session 48)."""
from pathlib import Path

import pytest

from eaglenest.config import apply_overrides
from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")


def test_an_override_given_twice_with_two_values_is_logged_and_the_later_wins(caplog):
    """A wrapper script's default then the user's own: the later is used (tests/common/test_cli_order.py),
    and the debug log (`-vv`) says so; not a warning, so a harness's error stays one line."""
    with caplog.at_level("DEBUG", logger="eaglenest.config"):
        out = apply_overrides({"train": {}}, ["train.lr=0.5", "train.lr=0.25"])
    assert out == {"train": {"lr": 0.25}}
    assert "override 'train.lr' given twice ('0.5', then '0.25'): the later one is used" in caplog.text


def test_an_override_repeated_with_the_same_value_is_taken(caplog):
    once = apply_overrides({}, ["train.lr=0.5"])
    with caplog.at_level("DEBUG", logger="eaglenest.config"):
        assert once == {"train": {"lr": 0.5}} and apply_overrides({}, ["train.lr=0.5", " train.lr=0.5"]) == once
    assert "given twice" not in caplog.text


@pytest.mark.parametrize("key,owner", [("lr", "train.lr"), ("checkpoint_subdir", "serve.checkpoint_subdir")])
def test_a_section_less_key_names_the_section_that_has_it(key, owner):
    with pytest.raises(ConfigError, match=rf"^{key}: unknown recipe section .*; did you mean {owner}\?$"):
        load_recipe(RECIPE, [f"{key}=1"])


def test_an_unknown_section_less_key_gets_no_guess():
    with pytest.raises(ConfigError) as err:
        load_recipe(RECIPE, ["no_such_key_anywhere=1"])
    assert "unknown recipe section" in str(err.value) and "did you mean" not in str(err.value)
