"""Mutation audit of capture (eleventh QA pass): each test kills a plausible mutant of the capture
code the suite let through, checking the behaviour from first principles (the documented bound or
format, an independent computation, an invariant), not the code's own output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, identity
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(commit_every=2, engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


def test_a_token_id_equal_to_the_vocabulary_size_is_outside_it(tiny_target):
    """Ids run 0..vocab_size-1: vocab_size itself is one past the embedding (the tiny target's tokenizer
    holds fewer ids than its 2048-row embedding, so the bound is the config's)."""
    rows = fs_helpers.prompt_rows(2, seed=4)
    rows[1]["response_token_ids"] = rows[1]["response_token_ids"][:-1] + [2047]
    build.check_token_ids(rows, str(tiny_target), vocab_size=2048)  # the last id: taken
    rows[1]["response_token_ids"] = rows[1]["response_token_ids"][:-1] + [2048]
    with pytest.raises(StoreError, match=r"^prompts row s-001: response_token_ids holds token id 2048, outside "
                                         r"the vocabulary of run\.target .* \(0\.\.2047\)"):
        build.check_token_ids(rows, str(tiny_target), vocab_size=2048)


def test_the_pool_is_the_answered_training_conversations(tmp_path, tiny_target):
    """A training row without an answer (finish_reason empty: no response came back) has nothing to train
    on and is not in the pool a feature set covers (nor its identity); held-out rows never are."""
    rows = fs_helpers.prompt_rows(4, seed=6)
    rows[1].update(response_token_ids=[], finish_reason="")
    rows[2].update(split="heldout")
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    assert [r["sample_id"] for r in build.pool_conversations(uri)] == ["s-000", "s-003"]


def test_fp8_rows_hold_the_documented_scale_and_codes():
    """docs/formats.md: an fp8 value is R fp32 scales, ``absmax(row) / 448``, then R x H e4m3fn codes with
    ``x ~= code x scale``; a scale of another divisor still round-trips (within e4m3's precision), so the
    format itself is checked: the scales against the rows' absmax, the codes against an independent
    e4m3fn decode (sign, 4 exponent bits of bias 7, 3 mantissa bits)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 3, 16)) * rng.uniform(0.01, 50, (5, 3, 1))).astype(np.float32)
    meta = S.FeatureMeta(target="t", layer_ids=(1, 2, 3), last_layer_id=4, hidden_size=16, dtype="float32",
                         feature_set_id="f", storage="fp8_e4m3")
    blob = S.encode_value(x, meta)
    rows = x.reshape(-1, 16)
    scales = np.frombuffer(blob[:4 * len(rows)], "<f4")
    np.testing.assert_allclose(scales, np.abs(rows).max(axis=1) / 448, rtol=1e-6)
    codes = np.frombuffer(blob[4 * len(rows):], np.uint8).reshape(rows.shape).astype(np.int64)
    sign, exp, man = np.where(codes & 0x80, -1.0, 1.0), (codes >> 3) & 0xF, codes & 0x7
    value = sign * np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    # the row's largest value is coded as 448 (e4m3fn's largest), every value within 2^-4 of it
    assert (np.abs(value).max(axis=1) == 448).all()
    np.testing.assert_allclose(value * scales[:, None], rows, rtol=2 ** -4, atol=float(scales.max()) * 2 ** -9)


def test_a_stored_identity_missing_a_component_it_always_had_is_not_this_feature_set(tmp_path, tiny_target):
    """Only components added to the identity later (``identity.ADDED``) may be missing from a table's
    record and still match: one whose record lacks, say, its storage mode was not hashed over it, so it is
    not known to hold this capture's tensors and is refused, naming the component."""
    rows = fs_helpers.prompt_rows(2, seed=1)
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    pool = build.pool_conversations(uri)
    meta = build.feature_meta(str(tiny_target), [2, 4, 5], "auto", sample_ids=[r["sample_id"] for r in pool],
                              gen_params_ids=[r["gen_params_id"] for r in pool])
    comps = {k: v for k, v in meta.identity_components.items() if k != "storage"}
    old = S.FeatureMeta(**{**json.loads(meta.to_json()), "layer_ids": meta.layer_ids,
                           "feature_set_id": identity.identity_hash(comps), "identity": json.dumps(comps)})
    store.append(uri, "features", fs_helpers.table(["x"], old, num_tokens=4), meta=old)
    with pytest.raises(StoreError, match=r"differs in storage \(key featurestore\.storage\)"):
        build.check_reuse(uri, "features", meta, [r["sample_id"] for r in pool])
    assert build.check_reuse(uri, "features", old, [r["sample_id"] for r in pool]) == old  # itself: reused


class _TokenStates(fs_helpers.StubCapturer):
    """The capture engine stand-in of :class:`fs_helpers.StubCapturer`, whose hidden states of each token
    are that token's id (every layer, every channel), so a row can be held to its own tokens."""

    def stream(self, seqs, **kwargs):
        for s in seqs:
            self.num_forward_passes += 1
            ids = np.asarray(s, np.float32)
            yield np.repeat(ids[:, None, None], self.layers, 1).repeat(128, 2), np.repeat(ids[:, None], 128, 1)


def test_each_row_holds_the_states_of_its_own_tokens(tmp_path, tiny_target, monkeypatch):
    """The conversations sent and the captures zipped with them must stay paired: conversations of equal
    length (which every size check passes) stored with another's states would train silently wrong."""
    monkeypatch.setattr(build, "Capturer", _TokenStates)
    rows = fs_helpers.prompt_rows(5, seed=9)  # all 22 tokens long
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    got = store.read(uri, store.FEATURES).to_pylist()
    assert sorted(r["sample_id"] for r in got) == [r["sample_id"] for r in rows]
    by_id = {r["sample_id"]: r for r in rows}
    for r in got:
        ids = by_id[r["sample_id"]]["prompt_token_ids"] + by_id[r["sample_id"]]["response_token_ids"]
        assert r["input_ids"] == ids
        aux = S.decode_tensor(r["aux_hidden"], (len(ids), 3, 128), "float32")
        last = S.decode_tensor(r["last_hidden"], (len(ids), 128), "float32")
        assert (aux == np.asarray(ids, np.float32)[:, None, None]).all()
        assert (last == np.asarray(ids, np.float32)[:, None]).all()
