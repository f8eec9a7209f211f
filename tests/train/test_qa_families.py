"""QA of the three draft families' recipe keys and paths: each found by a hostile run, each one line
naming the key."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig


@pytest.mark.parametrize("family, deep, key", [
    ("eagle3", {"ttt_steps": 100}, "train.ttt_steps"),
    ("peagle", {"peagle": PEagleConfig(num_slots=100)}, "train.peagle.num_slots"),
    ("dflash", {"dflash": DFlashConfig(block_size=100)}, "train.dflash.block_size"),
])
def test_a_depth_past_a_packed_row_is_refused_for_every_family(family, deep, key):
    """train.ttt_steps=100 with pack_tokens=64 trained (P-EAGLE and DFlash refused their depth): 70 of its
    100 unrolled steps had no target (step_count 0) for 100x the activation memory of one."""
    with pytest.raises(ConfigError) as e:
        TrainConfig(pack_tokens=64, family=family, **deep)
    assert str(e.value).startswith(f"{key}: 100 is more than a packed row holds (train.pack_tokens=64)")
    assert TrainConfig(pack_tokens=100, family=family, **deep).pack_tokens == 100
