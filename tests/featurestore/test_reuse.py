"""Feature-set identity with a real vLLM capture: reuse (zero passes), refusal, two drafts off one version."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import fragments, store
from eaglenest.featurestore.capture.build import capture
from eaglenest.featurestore.config import FeaturestoreConfig


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, r = rng.integers(3, 2000, 12 + i).tolist(), rng.integers(3, 2000, 20).tolist()
        rows.append({"sample_id": f"d{i % 2}-{i:04d}", "domain": f"d{i % 2}", "source": "synthetic",
                     "split": "train", "mode": "raw", "messages_json": "[]", "prompt_token_ids": p,
                     "response_token_ids": r, "finish_reason": "length", "gen_params_id": "g0"})
    return pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA)


@pytest.mark.slow
def test_identity_reuse_refusal_and_two_drafts_off_one_version(tmp_path, tiny_target):
    from eaglenest.train.config import StateConfig, TrainConfig
    from eaglenest.train.loop import train

    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, _prompts(6))
    # A 1 KiB write budget: every sample is its own engine batch and its own fragment (bounded memory).
    cfg = FeaturestoreConfig(commit_every=4, write_buffer_mb=1 / 1024,
                             engine=EngineConfig(max_model_len=128, memory_fraction=0.1, max_num_seqs=8))
    first = capture(target=str(tiny_target), store_uri=uri, cfg=cfg, lineage={"manifest_hash": "m1"})
    assert first["captured"] == 6 and first["target_forward_passes"] == 6 and not first["reused"]

    again = capture(target=str(tiny_target), store_uri=uri, cfg=cfg)
    assert again["reused"] and again["target_forward_passes"] == 0 and again["captured"] == 0
    assert again["feature_set_id"] == first["feature_set_id"]

    with pytest.raises(StoreError, match=r"layer_ids \(key featurestore.layer_ids\)"):
        capture(target=str(tiny_target), store_uri=uri, cfg=dataclasses.replace(cfg, layer_ids=[1, 4, 5]))

    ds = store.dataset(uri, store.FEATURES)
    pinned = ds.version
    lin = fragments.lineage_of(ds, pinned)
    assert lin["manifest_hash"] == "m1" and sum(lin["counts_per_domain"].values()) == 2  # 6 = 4 + 2
    assert len(ds.get_fragments()) == 6 and ds.count_rows() == 6  # 2 commits of 4 + 2 one-sample fragments
    before = store.read(uri, store.FEATURES, version=pinned)

    # A later append (same feature set) does not change what the pinned version reads.
    meta = S.feature_meta(ds.schema)
    extra = before.slice(0, 1).set_column(0, "sample_id", pa.array(["late-0"]))
    store.append(uri, store.FEATURES, extra, meta=meta)
    assert store.read(uri, store.FEATURES, version=pinned).equals(before)

    common = dict(num_steps=2, warmup_steps=1, pack_tokens=64, batch_rows=2, table_version=pinned,
                  state=StateConfig(every_steps=0), log_every_steps=1, num_threads=1)
    a = train(TrainConfig(draft_vocab_size=256, ttt_steps=2, output_subdir="a", **common), store_uri=uri,
              workdir=str(tmp_path), target_dir=str(tiny_target), seed=0)
    b = train(TrainConfig(draft_vocab_size=512, ttt_steps=3, output_subdir="b", **common), store_uri=uri,
              workdir=str(tmp_path), target_dir=str(tiny_target), seed=0)
    assert a.table_version == b.table_version == pinned and a.steps == b.steps == 2
