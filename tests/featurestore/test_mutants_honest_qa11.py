"""Mutation audit of the vocabulary checks and the weights hash (honest-tests pass 11): each test here failed on
a plausible mutant the newest tests let through.

* the vocabulary bound is exclusive: ``vocab_size`` itself is outside ``[0, vocab_size)``, on the table path (SQL)
  and on the stream path, and ``vocab_size - 1`` is a loss token counted like any other;
* the stream path checks the prompt's ids as well as the response's (the draft embeds every input token);
* ``weights_hash``'s per-process cache is keyed by the files' stat: weights rewritten in place (same path,
  same inode, same size) are hashed again."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from safetensors.torch import load_file, save_file

import fs_helpers as H
from stream_helpers import FS

from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import identity
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import store
from eaglenest.train.stream_source import StreamShards

VOCAB = 64


def _features(uri: str, changes: dict[tuple[int, int], int]) -> list[dict]:
    m = H.meta()
    rows = H.rows([f"s-{k}" for k in range(3)], m)
    for (k, pos), tok in changes.items():
        rows[k]["input_ids"][pos] = tok
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    return rows


def test_the_table_path_refuses_the_vocab_size_itself_and_counts_the_last_id(tmp_path):
    uri = str(tmp_path / "store")
    rows = _features(uri, {(1, 2): VOCAB - 1})  # position 2: a loss token (the mask is [0, 1, 1, ...])
    assert rows[1]["loss_mask"][2] == 1
    counts = query.loss_token_counts(uri, store.FEATURES, version=None, split="train", vocab_size=VOCAB)
    want = np.zeros(VOCAB, dtype=np.int64)
    for r in rows:
        np.add.at(want, np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1], 1)
    assert counts.shape == (VOCAB,) and np.array_equal(counts, want) and counts[VOCAB - 1] >= 1

    uri2 = str(tmp_path / "store2")
    _features(uri2, {(2, 0): VOCAB})  # a prompt position, one past the last id
    with pytest.raises(ConfigError, match=rf"sample 's-2': token id {VOCAB} is outside the target vocab "
                                          rf"\[0, {VOCAB}\)"):
        query.loss_token_counts(uri2, store.FEATURES, version=None, split="train", vocab_size=VOCAB)


def _stream(tmp_path, tiny_target) -> StreamShards:
    uri = H.prompts_store(tmp_path, H.prompt_rows(3, seed=4), tiny_target)
    return StreamShards(uri, featurestore=FS, target=str(tiny_target), split="train", pack_tokens=64, batch_rows=1,
                        seed=0, depth=1)


@pytest.mark.parametrize("where, pos", [("response_token_ids", 4), ("prompt_token_ids", 0)])
@pytest.mark.parametrize("offset", [0, 9])
def test_the_stream_path_refuses_an_id_at_or_past_the_vocab_in_prompt_or_response(tmp_path, tiny_target, where, pos,
                                                                                  offset):
    src = _stream(tmp_path, tiny_target)
    src.convs[2][where][pos] = 2048 + offset  # held in memory: a conversation tokenized for a larger vocab
    with pytest.raises(ConfigError, match=rf"sample '{src.convs[2]['sample_id']}': token id {2048 + offset} is "
                                          r"outside the target vocab \[0, 2048\)"):
        src.loss_token_counts(2048)


def test_the_stream_path_counts_the_last_id_of_the_vocab(tmp_path, tiny_target):
    src = _stream(tmp_path, tiny_target)
    src.convs[0]["response_token_ids"][0] = 2047
    counts = src.loss_token_counts(2048)
    want = np.bincount(np.concatenate([r["response_token_ids"] for r in src.convs]), minlength=2048)
    assert counts.shape == (2048,) and np.array_equal(counts, want) and counts[2047] >= 1


def test_weights_rewritten_in_place_are_hashed_again(tmp_path, tiny_target):
    folder = tmp_path / "target"
    shutil.copytree(tiny_target, folder)
    path = folder / "model.safetensors"
    before = identity.weights_hash(str(folder))
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1  # one value: the same size, the same inode once written in place
    data = tmp_path / "scratch.safetensors"
    save_file(tensors, str(data), metadata={"format": "pt"})
    inode, size = path.stat().st_ino, path.stat().st_size
    with open(path, "r+b") as f:  # in place: same path, same inode
        f.write(data.read_bytes())
    assert (path.stat().st_ino, path.stat().st_size) == (inode, size)
    after = identity.weights_hash(str(folder))
    assert after != before
    fresh = tmp_path / "fresh copy"  # the same content never hashed before: what a new process computes
    shutil.copytree(folder, fresh)
    assert identity.weights_hash(str(fresh)) == after
