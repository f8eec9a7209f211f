"""A new user's target that is not the tiny default, one property changed at a time, checked where the
docs promise something about it (README "Using your own target", docs/targets.md). No engine here: the
walk through every stage is tests/test_newuser_walk_qa8.py.

* A target whose config.json has a legacy ``rope_scaling`` beside ``rope_parameters`` (a transformers-5
  config extended the way model cards say, by adding ``rope_scaling``): transformers, and vLLM which
  loads the config through it, run the target with the legacy dict in place of ``rope_parameters``
  (its type and factor, theta from the top level or 10000). The draft kept ``rope_parameters``' type
  (``default``) with the legacy factor beside it, so it trained and served another rotary than the
  target's, where docs/targets.md says "The draft's rotary embedding is the target's".
* The layer counts whose default aux layers ``(2, L//2, L-3)`` must be set by hand: docs/targets.md says
  L = 1, 2, 4, 5, 6; a 3-layer target (default ``(2, 1, 0)``, distinct) was refused too, as "not
  ascending", and docs/tiny-target.md said "Only L >= 8 gives three distinct layers".
* A target of 2048 positions (TinyLlama, OPT, Pythia) under the stages' default engine length of 4096:
  ``ingest build`` and ``featurestore capture`` refused it; an engine length the recipe leaves unset now
  fits the target (``recipe._fit_lengths``), one it gives is kept and refused naming the key.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.build import feature_meta
from eaglenest.ingest.commands import check_target_loads
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.recipe import load_recipe
from eaglenest.target import read_config
from eaglenest.train.model import draft_rope

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "toy.yaml")

ROPES = {
    # transformers-5 rope_parameters plus a legacy rope_scaling added by hand: the legacy one is what runs.
    "linear_beside_default": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "yarn_beside_theta_1e6": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 8192}},
    "dynamic_with_top_level_theta": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    # One of the two only (released checkpoints): these always matched; they must keep matching.
    "legacy_llama3_only": {"rope_parameters": None, "rope_theta": 5e5,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "rope_parameters_only": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 3.0}},
}


@pytest.mark.parametrize("case", sorted(ROPES))
def test_the_draft_rotary_is_the_one_the_target_runs(config_target, case):
    changes = ROPES[case]
    target = config_target(**changes)
    if changes.get("rope_parameters", {}) is None:  # a config as transformers 4 wrote it: no rope_parameters key
        cfg = json.loads((target / "config.json").read_text())
        cfg.pop("rope_parameters")
        (target / "config.json").write_text(json.dumps(cfg))
    runs = dict(AutoConfig.from_pretrained(str(target)).rope_parameters)  # what vLLM's config loader gives too
    runs.pop("type", None)  # the legacy name of rope_type, kept beside it
    assert draft_rope(read_config(target)) == runs


def test_the_layer_counts_docs_say_need_explicit_aux_layers_are_the_ones_refused(config_target):
    """docs/targets.md lists the layer counts whose default aux layers are refused ("L = 1, 2, 4, 5, 6: set
    them explicitly"); every other count must capture with the default (a 3-layer target was refused too)."""
    text = (ROOT / "docs" / "targets.md").read_text(encoding="utf-8")
    listed = {int(n) for n in re.search(r"\(L = ([\d, ]+): set them explicitly\)", text).group(1).split(",")}
    refused = set()
    for num_layers in range(1, 13):
        try:
            meta = feature_meta(str(config_target(folder=f"t{num_layers}", num_hidden_layers=num_layers)), [], "auto")
        except ConfigError as exc:
            assert str(exc).startswith("featurestore.layer_ids: the default rule gives"), exc
            refused.add(num_layers)
            continue
        assert list(meta.layer_ids) == sorted(meta.layer_ids) and len(meta.layer_ids) == 3, meta.layer_ids
    assert refused == listed == {1, 2, 4, 5, 6}


def test_engine_lengths_left_unset_fit_a_target_of_fewer_positions(config_target, tiny_target, capsys):
    """A 2048-position target (TinyLlama, OPT, Pythia) under the stages' default engine length of 4096:
    `ingest build` and `featurestore capture` refused it ("set ingest.engine.max_model_len=2048") while
    `evaluate al` took the target's own. A length the recipe leaves unset is now the target's everywhere
    (`--dry-run` shows it); one the recipe gives is kept, and refused before any engine starts."""
    target = config_target(max_position_embeddings=2048)
    assert EngineConfig().max_model_len == 4096
    recipe = load_recipe(RECIPE, [f"run.target={target}"])
    assert [recipe.ingest.engine.max_model_len, recipe.featurestore.engine.max_model_len,
            recipe.evaluate.engine.max_model_len, recipe.serve.max_model_len] == [2048, 2048, 2048, 2048]
    small = config_target(folder="small", max_position_embeddings=1024)
    recipe = load_recipe(RECIPE, [f"run.target={small}", "featurestore.engine.max_model_len=512"])
    assert [recipe.ingest.engine.max_model_len, recipe.featurestore.engine.max_model_len,
            recipe.evaluate.engine.max_model_len, recipe.serve.max_model_len] == [1024, 512, 1024, 1024]
    assert load_recipe(RECIPE, [f"run.target={tiny_target}"]).ingest.engine.max_model_len == 4096  # 32768 positions
    # a linear rotary factor counts, as vLLM counts it
    scaled = config_target(folder="scaled", max_position_embeddings=1024, rope_scaling={"type": "linear", "factor": 2.0})
    assert load_recipe(RECIPE, [f"run.target={scaled}"]).featurestore.engine.max_model_len == 2048
    assert ingest_main(["build", "--recipe", RECIPE, "--dry-run", f"run.target={target}"]) == 0
    assert json.loads(capsys.readouterr().out)["ingest"]["engine"]["max_model_len"] == 2048
    # a length given is the user's: refused naming the key and the target's limit
    given = load_recipe(RECIPE, [f"run.target={target}", "ingest.engine.max_model_len=4096"])
    assert given.ingest.engine.max_model_len == 4096
    with pytest.raises(ConfigError, match=r"^ingest\.engine\.max_model_len: 4096 is more than .* has positions for "
                                          r"\(max_position_embeddings=2048\); set ingest\.engine\.max_model_len=2048"):
        check_target_loads(str(target), trust_remote_code=False, max_model_len=given.ingest.engine.max_model_len)
    check_target_loads(str(target), trust_remote_code=False, max_model_len=recipe_len(target))


def recipe_len(target: Path) -> int:
    return load_recipe(RECIPE, [f"run.target={target}"]).ingest.engine.max_model_len
