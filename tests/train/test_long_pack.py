"""Long stored samples packed into one row train through the chunked attention path.

Three samples of ~400 tokens, stored like any capture (features of a real forward pass), are
packed into a single row of ``pack_tokens`` (documents kept apart, positions restarting), and a
training run whose rows are longer than ``attn_chunk_tokens`` takes query chunks (the path a
32K-token row takes) with the losses of the dense path. The 32K figures themselves are bench/
material (docs/training.md).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from eaglenest.train.config import TrainConfig
from eaglenest.errors import ConfigError
from eaglenest.train.data import FeatureShards, plan_batches
from eaglenest.train.loop import train


@pytest.fixture(scope="module")
def long_store(tmp_path_factory, synth, tiny_target):
    uri = str(tmp_path_factory.mktemp("long") / "store")
    g = torch.Generator().manual_seed(5)
    samples = []
    for n in (400, 360, 380):
        ids = torch.randint(3, 2048, (n,), generator=g).tolist()
        samples.append((ids, [0] * 32 + [1] * (n - 32)))
    synth.write_features(uri, tiny_target, samples)
    return uri, [400, 360, 380]


def test_long_samples_pack_into_one_row(long_store):
    uri, lengths = long_store
    shards = FeatureShards(uri, version=None, split="train", pack_tokens=1200, batch_rows=1, seed=0)
    try:
        plan = shards.plan(0)
        assert [len(row) for batch in plan for row in batch] == [3]  # one row holds all three
        batch = shards.read(plan[0])
    finally:
        shards.close()
    assert batch.input_ids.shape == (1, sum(lengths))
    docs = batch.doc_ids[0].tolist()
    assert sorted(docs.count(d) for d in set(docs)) == sorted(lengths)
    starts = [i for i in range(len(docs)) if i == 0 or docs[i] != docs[i - 1]]
    assert [batch.position_ids[0, s].item() for s in starts] == [0, 0, 0]  # positions restart per document
    assert batch.position_ids[0].max().item() == max(lengths) - 1


@pytest.mark.slow
def test_a_long_row_trains_with_chunked_attention_as_the_dense_path_does(tmp_path, long_store, tiny_target):
    uri, lengths = long_store
    first = {}
    for chunk in (128, 2048):  # query chunks (the long-row path) vs one dense [T, T] per head
        cfg = TrainConfig(draft_vocab_size=256, ttt_steps=2, pack_tokens=1200, batch_rows=1, attn_chunk_tokens=chunk,
                          num_epochs=2, warmup_steps=1, log_every_steps=1, lr=3e-3)
        s = train(cfg, store_uri=uri, workdir=str(tmp_path / f"w{chunk}"), target_dir=str(tiny_target), seed=0,
                  argv=["test"])
        losses = [json.loads(x)["loss"] for x in (s.outdir / "metrics.jsonl").read_text().splitlines() if "loss" in x]
        assert s.steps == 2 and len(losses) == 2 and all(math.isfinite(v) for v in losses)
        first[chunk] = losses
    assert sum(lengths) > 128  # the first run took the chunked path
    # the same row, the same loss; and the step that followed it, from the same gradients
    assert first[128] == pytest.approx(first[2048], rel=1e-4)


def test_row_tokens_fills_short_rows_and_gives_a_long_sample_its_own_row():
    # 2 long samples among 20 short ones: rows of 300 for the short, a whole row for each long one
    lengths = [100] * 20 + [900, 1500]
    for epoch in range(3):
        plan = plan_batches(lengths, pack_tokens=1200, batch_rows=1, seed=7, epoch=epoch, row_tokens=300)
        rows = [row for batch in plan for row in batch]
        assert sorted(i for row in rows for i in row) == list(range(22))  # every sample once
        for row in rows:
            if any(lengths[i] > 300 for i in row):
                assert len(row) == 1  # a long sample alone
            else:
                assert sum(lengths[i] for i in row) <= 300
        short = [row for row in rows if all(lengths[i] <= 300 for i in row)]
        assert len(rows) - len(short) == 2
        assert 7 <= len(short) <= 9  # 3 per row; a long sample may close one early (twice at most)
        # the same plan as pack_tokens alone when row_tokens is 0 or pack_tokens
        same = plan_batches(lengths, pack_tokens=1200, batch_rows=1, seed=7, epoch=epoch)
        assert same == plan_batches(lengths, pack_tokens=1200, batch_rows=1, seed=7, epoch=epoch, row_tokens=1200)
        assert len(same) < len(rows)


def test_row_tokens_above_pack_tokens_is_refused():
    with pytest.raises(ConfigError, match="train.row_tokens"):
        TrainConfig(pack_tokens=512, row_tokens=1024)
    with pytest.raises(ConfigError, match="train.row_tokens"):
        TrainConfig(row_tokens=-1)
