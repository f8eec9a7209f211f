"""A features table with a token id outside the target's vocabulary in a prompt position (hostile pass 10).

Imported features from another tokenizer (``run.off_policy=true``) passed the vocabulary check, which
looked only at loss tokens, and training crashed at its first step with an IndexError in the draft's
embedding (it embeds every input token). It is refused before the first step, in one line."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store
from eaglenest.train.config import StateConfig, TrainConfig
from eaglenest.train.loop import train


def test_training_refuses_an_input_token_outside_the_vocab_before_its_first_step(tmp_path, synth, tiny_target):
    # The refusal comes before any step reads a hidden state: random in-vocab ids and random states of the
    # target's shapes (no model run) reach it the way captured ones do.
    vocab, hidden = synth.TARGET_SHAPE["vocab_size"], synth.TARGET_SHAPE["hidden_size"]
    rng = np.random.default_rng(0)
    samples = [(rng.integers(3, vocab, 16).tolist(), [0] * 8 + [1] * 8) for _ in range(4)]
    feats = [(rng.standard_normal((16, len(synth.LAYER_IDS), hidden)), rng.standard_normal((16, hidden)))
             for _ in samples]
    meta = S.FeatureMeta(target=str(tiny_target), layer_ids=synth.LAYER_IDS, last_layer_id=8,
                         hidden_size=synth.TARGET_SHAPE["hidden_size"], dtype="float32")
    rows = []
    for i, ((ids, mask), (aux, last)) in enumerate(zip(samples, feats)):
        ids = list(ids)
        if i == 2:
            assert mask[3] == 0
            ids[3] = vocab + 7  # another tokenizer's id, in the prompt
        rows.append(dict(sample_id=f"imported-{i}", domain="d", source="specforge", split="train", mode="raw",
                         gen_params_id="g", num_tokens=len(ids), num_loss_tokens=int(sum(mask)), input_ids=ids,
                         loss_mask=list(mask), aux_hidden=S.encode_tensor(np.asarray(aux, "<f4"), "float32"),
                         last_hidden=S.encode_tensor(np.asarray(last, "<f4"), "float32")))
    uri = str(tmp_path / "store")
    store.append(uri, store.FEATURES, pa.Table.from_pylist(rows, schema=S.features_schema(meta)), meta=meta)
    cfg = TrainConfig(draft_vocab_size=64, ttt_steps=2, pack_tokens=32, batch_rows=2, warmup_steps=1,
                      log_every_steps=1, num_steps=2, num_threads=1, state=StateConfig(every_steps=1))
    work = tmp_path / "w"
    with pytest.raises(ConfigError) as e:
        train(cfg, store_uri=uri, workdir=str(work), target_dir=str(tiny_target), seed=0, argv=["test"])
    msg = str(e.value)
    assert "\n" not in msg and "'features'" in msg and "sample 'imported-2'" in msg
    assert f"token id {vocab + 7} is outside the target vocab [0, {vocab})" in msg
    assert not (work / "train" / "draft.safetensors").exists() and not (work / "train" / "state").exists()
