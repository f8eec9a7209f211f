"""``train.source=stream``'s draft-vocabulary counts (hostile pass 11): a token id outside ``[0, vocab_size)``
is one line naming the sample and the id, as the table path's SQL count says it. The stream path dropped an id
past the vocab without a word (``np.bincount(...)[:vocab_size]``) and crashed in numpy on a negative one.
No engine: the stream is planned from the prompts table, its engine starts only in ``start``."""

from __future__ import annotations

import numpy as np
import pytest

import fs_helpers as H
from stream_helpers import FS

from eaglenest.errors import ConfigError
from eaglenest.train.stream_source import StreamShards


def _stream(uri: str, target) -> StreamShards:
    return StreamShards(uri, featurestore=FS, target=str(target), split="train", pack_tokens=64, batch_rows=1,
                        seed=0, depth=1)


def test_counts_of_in_vocab_ids_are_the_loss_tokens(tmp_path, tiny_target):
    rows = H.prompt_rows(4, seed=2)
    src = _stream(H.prompts_store(tmp_path, rows, tiny_target), tiny_target)
    counts = src.loss_token_counts(2048)
    want = np.bincount(np.concatenate([r["response_token_ids"] for r in rows]), minlength=2048)
    assert counts.shape == (2048,) and np.array_equal(counts, want) and counts.sum() == 4 * 12


def test_an_id_past_the_config_vocab_is_named_not_dropped(tmp_path, config_target):
    """A target whose tokenizer holds more ids than its config's vocab_size (the tiny target's 1141 tokens over
    a vocab_size of 1100): the rows pass the engine's bound (the tokenizer's length), and the trainer counts
    against the config's vocab_size, which the table path's count refuses."""
    target = config_target(vocab_size=1100)
    rows = H.prompt_rows(3, seed=1)
    for r in rows:  # ids the tokenizer has; one response token past the config's vocab
        r["prompt_token_ids"] = [t % 1100 for t in r["prompt_token_ids"]]
        r["response_token_ids"] = [t % 1100 for t in r["response_token_ids"]]
    rows[1]["response_token_ids"][5] = 1120
    src = _stream(H.prompts_store(tmp_path, rows, target), target)
    with pytest.raises(ConfigError) as err:
        src.loss_token_counts(1100)
    assert str(err.value).startswith(f"prompts v{src.version}, sample '{rows[1]['sample_id']}': token id 1120 is "
                                     "outside the target vocab [0, 1100)"), err.value
    assert "\n" not in str(err.value)


def test_a_negative_id_is_named_not_a_numpy_error(tmp_path, tiny_target):
    src = _stream(H.prompts_store(tmp_path, H.prompt_rows(2), tiny_target), tiny_target)
    src.convs[1]["response_token_ids"][3] = -7  # a row the table would have refused on read, held in memory
    with pytest.raises(ConfigError, match=rf"sample '{src.convs[1]['sample_id']}': token id -7 is outside the "
                                          r"target vocab \[0, 2048\)"):
        src.loss_token_counts(2048)
