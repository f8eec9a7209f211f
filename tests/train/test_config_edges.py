"""``train`` settings that would train nothing are refused when the recipe loads, naming the key."""

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train.config import TrainConfig


@pytest.mark.parametrize("size", [0, 1])
def test_draft_vocab_of_one_token_refused(size):
    """A draft vocabulary of one token: its softmax is 1 whatever the draft computes, so the loss is 0
    from the first step and nothing is learnt; refused before any data is read."""
    with pytest.raises(ConfigError, match=f"train.draft_vocab_size: must be >= 2 .* got {size}$"):
        TrainConfig(draft_vocab_size=size)
    assert TrainConfig(draft_vocab_size=2).draft_vocab_size == 2
