"""Eighth QA pass on `featurestore capture`: the default aux layers of targets with few layers. The
rule ``(2, L//2, L-3)`` gives ids past the target (L = 1, 2) or out of layer order (L = 3): the first
were refused as if the user had given them ("featurestore.layer_ids: [-1] outside 0..1"), the last
refused as "not ascending" although vLLM hands aux layers over in layer order anyway."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.build import feature_meta
from eaglenest.featurestore.capture.engine import resolve_layer_ids


@pytest.mark.parametrize("num_layers", [1, 2, 4, 5, 6])
def test_a_default_rule_that_gives_no_three_layers_of_the_target_says_so(num_layers):
    with pytest.raises(ConfigError, match=rf"^featurestore\.layer_ids: the default rule gives \(.*\) for a "
                                          rf"{num_layers}-layer target; set three distinct ids in "
                                          rf"0\.\.{num_layers - 1} explicitly$"):
        resolve_layer_ids([], num_layers)


@pytest.mark.parametrize("num_layers", [3, 7, 8, 61])
def test_the_default_rule_is_three_distinct_layers_of_the_target_in_layer_order(num_layers):
    ids = resolve_layer_ids([], num_layers)
    assert list(ids) == sorted({2, num_layers // 2, num_layers - 3})
    assert len(ids) == 3 and all(0 <= i < num_layers for i in ids)


def test_a_three_layer_target_is_captured_with_its_default_layers(config_target):
    meta = feature_meta(str(config_target(num_hidden_layers=3)), [], "auto")
    assert meta.layer_ids == (0, 1, 2) and meta.last_layer_id == 3
