"""`train run`'s memory refusal names the key that drives the step's size, the draft's own layer sizes
(train.draft.*) included: a huge intermediate_size was refused naming train.pack_tokens."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline import commands
from eaglenest.recipe import load_recipe


@pytest.mark.parametrize("key, value", [("intermediate_size", 100_000_000), ("num_attention_heads", 100_000)])
def test_a_draft_size_past_memory_is_refused_naming_it(tiny_target, key, value):
    recipe = load_recipe("recipes/toy.yaml", [f"run.target={tiny_target}", f"train.draft.{key}={value}"])
    with pytest.raises(ConfigError) as info:
        commands.check_fit(recipe, available=8 << 30)
    assert str(info.value).startswith(f"train.draft.{key}: "), str(info.value)
    assert f"lower train.draft.{key}" in str(info.value)
    commands.check_fit(load_recipe("recipes/toy.yaml", [f"run.target={tiny_target}"]), available=8 << 30)
