"""``train run``'s memory check sizes one rank's step: its share of the batch, its share of a
context-parallel row, the aux layers the recipe captures."""

from __future__ import annotations

import json

import pytest

from eaglenest.pipeline.commands import _train_estimate
from eaglenest.recipe import load_recipe


@pytest.mark.parametrize("world,cp,rows,tokens", [(1, 1, 3, 513), (4, 2, 2, 257), (2, 1, 2, 513), (6, 2, 1, 257)])
def test_one_ranks_step_is_its_share_of_the_batch_and_of_the_row(root, tiny_target, monkeypatch, world, cp, rows,
                                                                  tokens):
    """batch_rows=3 over world / cp data-parallel ranks (rounded up: a rank may hold the extra row); a row
    of 513 tokens split over cp ranks (rounded up); four aux layers plus the last one per position."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    r = load_recipe(str(root / "recipes" / "toy.yaml"), [
        f"run.target={tiny_target}", f"train.context_parallel={cp}", "train.batch_rows=3", "train.pack_tokens=513",
        "featurestore.layer_ids=[1, 2, 3, 4]"])
    cfg = json.loads((tiny_target / "config.json").read_text())
    est = _train_estimate(r, cfg, r.train)
    assert f"{rows} row(s) of {tokens} tokens" in est.what
    assert est.parts["features"] == rows * tokens * (4 + 1) * cfg["hidden_size"] * 4  # fp32
