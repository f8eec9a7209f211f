"""The draft vocabulary's count checks every input token the trainer reads (hostile pass 10).

Features imported from another tokenizer (``run.off_policy=true``) may hold a token id outside the
target's vocabulary in a prompt position (loss mask 0). The check looked only at loss tokens, so such
a table passed it and training crashed mid-run with an IndexError in the draft's embedding."""

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import store

import fs_helpers as H  # on sys.path via conftest

VOCAB = 64


def with_ids(m, changes: dict[tuple[int, int], int], *, name="features", uri, split=None, no_loss=()):
    """Append H.rows with input_ids[row][pos] = id for each ((row, pos), id) of ``changes``."""
    rows = H.rows([f"s-{k}" for k in range(4)], m)
    for (k, pos), tok in changes.items():
        rows[k]["input_ids"][pos] = tok
    for k in no_loss:
        rows[k]["loss_mask"] = [0] * rows[k]["num_tokens"]
        rows[k]["num_loss_tokens"] = 0
    if split:
        for k, s in split.items():
            rows[k]["split"] = s
    store.append(uri, name, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    return rows


@pytest.mark.parametrize("bad", [VOCAB + 935, -3, 2**31 - 1])
def test_an_id_outside_the_vocab_in_a_prompt_position_is_refused_naming_table_and_sample(tmp_path, bad):
    uri, m = str(tmp_path / "store"), H.meta()
    rows = with_ids(m, {(2, 0): bad}, uri=uri, name="feat-v2")
    assert rows[2]["loss_mask"][0] == 0  # a prompt position: the loss tokens are all in the vocab
    with pytest.raises(ConfigError) as e:
        query.loss_token_counts(uri, "feat-v2", version=None, split="train", vocab_size=VOCAB)
    msg = str(e.value)
    assert "\n" not in msg
    assert "'feat-v2'" in msg and "sample 's-2'" in msg
    assert f"token id {bad} is outside the target vocab [0, {VOCAB})" in msg


def test_both_ends_out_of_range_names_one_of_them(tmp_path):
    uri, m = str(tmp_path / "store"), H.meta()
    with_ids(m, {(1, 0): -5, (3, 0): 10**6}, uri=uri)
    with pytest.raises(ConfigError, match=r"sample 's-1': token id -5 is outside the target vocab \[0, 64\)"):
        query.loss_token_counts(uri, store.FEATURES, version=None, split="train", vocab_size=VOCAB)


def test_rows_the_trainer_does_not_read_are_not_refused_and_counts_are_unchanged(tmp_path):
    """A held-out row, or one without a loss token (never trained on), may hold any id: the counts are
    those of the loss tokens of the train rows, derived here by hand."""
    uri, m = str(tmp_path / "store"), H.meta()
    rows = with_ids(m, {(1, 0): 999, (3, 2): 999}, uri=uri, split={1: "heldout"}, no_loss=(3,))
    got = query.loss_token_counts(uri, store.FEATURES, version=None, split="train", vocab_size=VOCAB)
    want = [0] * VOCAB
    for r in rows:
        if r["split"] == "train":
            for tok, keep in zip(r["input_ids"], r["loss_mask"]):
                if keep:
                    want[tok] += 1
    assert got.tolist() == want and sum(want) > 0
