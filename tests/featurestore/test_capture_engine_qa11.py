"""A hostile capture with a real vLLM engine (eleventh QA pass; one engine start for the module):
bfloat16, aux layers off vLLM's default (the embeddings' output, id 0, among them), a store whose path
holds spaces, conversations of one and two tokens and several of the same length. The stored states are
held to transformers' ``output_hidden_states`` (an independent forward), then re-runs: the same settings
reuse the table without a forward pass, other layers are refused and leave it as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eaglenest.engine import EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

pytestmark = pytest.mark.slow

LAYERS = [0, 3, 7]
CFG = FeaturestoreConfig(commit_every=3, layer_ids=LAYERS,
                         engine=EngineConfig(max_model_len=64, memory_fraction=0.1, dtype="bfloat16"))


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny_target):
    rows = fs_helpers.prompt_rows(5, seed=5)  # s-002..s-004: 22 tokens each
    rows[0].update(prompt_token_ids=[5], response_token_ids=[7])
    rows[1].update(prompt_token_ids=[9], response_token_ids=[])  # one token, nothing to train on
    uri = fs_helpers.prompts_store(tmp_path_factory.mktemp("qa11") / "a store with spaces", rows, tiny_target)
    stats = build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    return uri, rows, stats


def test_the_stored_states_are_transformers_hidden_states_at_the_layer_ids(captured, tiny_target):
    uri, rows, stats = captured
    assert stats["captured"] == stats["target_forward_passes"] == 5 and stats["dtype"] == "bfloat16"
    ds = store.dataset(uri, store.FEATURES)
    meta = S.feature_meta(ds.schema)
    assert list(meta.layer_ids) == LAYERS and meta.last_layer_id == 8
    got = {r["sample_id"]: r for r in ds.to_table(**store.BYTES).to_pylist()}
    assert sorted(got) == [r["sample_id"] for r in rows]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32).eval()
    for conv in rows:
        row = got[conv["sample_id"]]
        ids = conv["prompt_token_ids"] + conv["response_token_ids"]
        T = len(ids)
        assert row["input_ids"] == ids and row["num_tokens"] == T
        assert row["loss_mask"] == [0] * len(conv["prompt_token_ids"]) + [1] * len(conv["response_token_ids"])
        aux = S.torch_from_blob(row["aux_hidden"], (T, 3, 128), "bfloat16").float()
        last = S.torch_from_blob(row["last_hidden"], (T, 128), "bfloat16").float()
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            # vLLM id L is before the final norm; transformers' last entry after it
            pairs = [(aux[:, j], hs[layer][0]) for j, layer in enumerate(LAYERS)] + [(model.model.norm(last), hs[8][0])]
        for k, (mine, ref) in enumerate(pairs):  # bf16 through 8 blocks: a few % of the layer's scale
            err = float((mine - ref).abs().max() / ref.abs().max())
            assert err < 0.04, (conv["sample_id"], k, err)


def test_a_rerun_with_the_same_settings_reuses_the_table_without_a_forward_pass(captured, tiny_target):
    uri, _, stats = captured
    again = build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert again["reused"] and again["captured"] == again["target_forward_passes"] == 0
    assert again["feature_set_id"] == stats["feature_set_id"]
    assert again["features_table_version"] == stats["features_table_version"]


def test_a_rerun_with_other_layers_is_refused_and_leaves_the_table(captured, tiny_target):
    uri, _, stats = captured
    other = FeaturestoreConfig(commit_every=3, layer_ids=[2, 4, 5], engine=CFG.engine)
    with pytest.raises(StoreError, match=r"differs in layer_ids \(key featurestore\.layer_ids\)\. Set "
                                         r"featurestore\.table to a new name"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=other)
    assert store.latest_version(uri, store.FEATURES) == stats["features_table_version"]
