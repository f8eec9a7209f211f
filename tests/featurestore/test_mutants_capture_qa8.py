"""Mutation audit of capture (eighth QA pass): each test here kills a plausible mutant of the capture
code that the suite let through, checking the behaviour from first principles (an independent
reference, an invariant, a round trip), not the code's own output."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture import build, identity
from eaglenest.featurestore.capture.engine import Capturer, resolve_layer_ids
from eaglenest.featurestore.capture.writer import FeatureWriter, bytes_per_token, captured_bytes_per_token
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store, versions

import fs_helpers  # on sys.path via conftest

CFG = FeaturestoreConfig(commit_every=2, engine=EngineConfig(max_model_len=64, memory_fraction=0.1))


def _comps(tiny_target, **kw) -> dict:
    args = {"target": str(tiny_target), "layer_ids": [2, 4, 5], "last_layer_id": 8, "dtype": "float32",
            "storage": "raw", "sample_ids": ["a", "b"], "gen_params_ids": ["g0"], **kw}
    return identity.components(**args)


def test_every_identity_component_but_the_target_path_changes_the_feature_set_id(tiny_target):
    """identity_hash must not leave a component out (a storage mode, a dtype, the pool...): two feature
    sets that differ in any one of them hold other tensors (or other rows)."""
    comps = _comps(tiny_target)
    base = identity.identity_hash(comps)
    assert identity.identity_hash({**comps, "target": "/moved/elsewhere"}) == base  # a path is a name
    for key, value in comps.items():
        if key == "target":
            continue
        other = value + [99] if isinstance(value, list) else (value + 1 if isinstance(value, int) else f"{value}x")
        assert identity.identity_hash({**comps, key: other}) != base, key


def test_the_pool_and_the_generation_settings_are_the_feature_sets_content(tiny_target):
    """Another pool of the same size, or one more generation setting, is another feature set: the
    identity holds the pool's ids and every generation setting, not their counts or the first."""
    ids = identity.identity_hash
    same = ids(_comps(tiny_target, sample_ids=["b", "a"]))
    assert ids(_comps(tiny_target)) == same  # the order rows were read in is no difference
    assert ids(_comps(tiny_target, sample_ids=["a", "c"])) != same
    assert ids(_comps(tiny_target, gen_params_ids=["g0", "g1"])) != same
    assert ids(_comps(tiny_target, gen_params_ids=["g0", "g0"])) == same


def test_the_template_identity_is_the_template_transformers_loads(tmp_path, tiny_target):
    """A target with a chat_template.jinja beside tokenizer_config.json's template: the tokenizer (and
    vLLM) render with the .jinja one, so that is the one an edit of must change the identity."""
    target = tmp_path / "jinja target"
    shutil.copytree(tiny_target, target)
    jinja = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|end|>{% endfor %}"
    (target / "chat_template.jinja").write_text(jinja)
    loaded = AutoTokenizer.from_pretrained(target).chat_template
    assert loaded == jinja
    assert identity.chat_template_text(target) == loaded
    assert identity.tokenizer_hashes(str(target))[1] == hashlib.sha256(loaded.encode()).hexdigest()


def test_aux_layers_given_out_of_layer_order_are_refused(tiny_target):
    """vLLM hands a capture's aux layers over in layer order whatever order they were asked in, so a
    descending list would store each layer's states under another layer's id."""
    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: \[5, 2, 4\] is not ascending.*give \[2, 4, 5\]"):
        build.feature_meta(str(tiny_target), [5, 2, 4], "auto")
    assert build.feature_meta(str(tiny_target), [2, 4, 5], "auto").layer_ids == (2, 4, 5)


@pytest.mark.parametrize("num_layers", [3, 8, 13])
def test_the_last_layer_captured_is_the_targets_last_block(config_target, num_layers):
    """vLLM id L (config.json's num_hidden_layers) is the last block's output, the trainer's basis of
    the target's own distribution: one less would be another layer's states under the last's name."""
    target = config_target(num_hidden_layers=num_layers)
    meta = build.feature_meta(str(target), [0, 1, 2], "auto")
    assert meta.last_layer_id == json.loads((target / "config.json").read_text())["num_hidden_layers"]
    assert meta.identity_components["last_layer_id"] == num_layers


@pytest.mark.parametrize(("engine_dtype", "stored"), [("auto", "float32"), ("bfloat16", "bfloat16"),
                                                      ("half", "float16"), ("float", "float32")])
def test_the_table_dtype_is_the_engines(tiny_target, engine_dtype, stored):
    """The tensors are stored in the dtype the engine runs in: the checkpoint's for "auto" (the tiny
    target's config.json says float32), else the one asked for (vLLM's names)."""
    assert json.loads((tiny_target / "config.json").read_text())["dtype"] == "float32"
    meta = build.feature_meta(str(tiny_target), [], engine_dtype)
    assert meta.dtype == stored and meta.identity_components["dtype"] == stored


def test_held_out_rows_are_never_captured_even_with_a_response(tmp_path, tiny_target, monkeypatch):
    """Features are the training split's: a held-out row that holds a response (a table another tool
    wrote, or ingest one day regenerating them) must stay out of the training features."""
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    rows = fs_helpers.prompt_rows(3, seed=5)
    rows[1].update(split="heldout", finish_reason="stop")
    uri = fs_helpers.prompts_store(tmp_path, rows, tiny_target)
    stats = build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert stats["captured"] == 2
    assert store.sample_ids(uri, store.FEATURES) == {rows[0]["sample_id"], rows[2]["sample_id"]}


class _OtherDtypeCapturer(fs_helpers.StubCapturer):
    """The stub engine (named so) handing over bfloat16 states (uint16 bit patterns) for a float32 table."""

    def stream(self, seqs, **kwargs):
        for aux, last in super().stream(seqs, **kwargs):
            yield aux.astype(np.uint16), last.astype(np.uint16)


def test_states_of_another_dtype_than_the_table_are_refused_naming_the_key(tmp_path, tiny_target, monkeypatch):
    monkeypatch.setattr(build, "Capturer", _OtherDtypeCapturer)
    uri = fs_helpers.prompts_store(tmp_path, fs_helpers.prompt_rows(2, seed=6), tiny_target)
    with pytest.raises(StoreError, match=r"^engine produced bfloat16, table is float32: set "
                                         r"featurestore\.engine\.dtype$"):
        build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    assert not store.exists(uri, store.FEATURES)


def test_a_multimodal_wrappers_language_model_sets_the_shapes(config_target, tiny_target):
    """A wrapper's top level (a vision tower's sizes, say) is not the language model: the layer count,
    width and dtype come from its text_config, the dtype from the top when the text_config has none."""
    text = json.loads((tiny_target / "config.json").read_text())
    text.pop("dtype"), text.pop("torch_dtype")
    target = config_target(text_config=text, num_hidden_layers=2, hidden_size=64, dtype="float16",
                           torch_dtype="float16")
    meta = build.feature_meta(str(target), [], "auto")
    assert (meta.last_layer_id, meta.hidden_size, meta.dtype) == (8, 128, "float16")
    assert meta.layer_ids == (2, 4, 5)


def test_layer_ids_span_the_embeddings_to_the_block_before_the_last():
    """vLLM ids: 0 is the embedding output (a valid aux layer), L the last block's output, captured
    once as last_hidden already (as an aux layer it would be stored twice); past L is no layer."""
    assert resolve_layer_ids([0, 3, 7], 8) == (0, 3, 7)
    with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: 8 is the last layer, captured separately"):
        resolve_layer_ids([2, 4, 8], 8)
    for bad in ([2, 4, 9], [-1, 2, 4]):
        with pytest.raises(ConfigError, match=r"featurestore\.layer_ids: .* outside 0\.\.7"):
            resolve_layer_ids(bad, 8)


def test_each_commits_lineage_counts_the_rows_it_added(tmp_path):
    """``counts_per_domain`` of a commit's lineage (what `featurestore versions` shows) is that
    commit's rows, per domain: the rows the version added, read back, not a running total."""
    uri, m = str(tmp_path / "störe"), fs_helpers.meta(hidden=16)
    writer = FeatureWriter(uri, store.FEATURES, m, budget=1 << 20)
    versions_added = []
    for ids, domain in ((["a", "b"], "x"), (["c"], "y"), (["d", "e", "f"], "x")):
        for row in fs_helpers.rows(ids, m, domain=domain):
            writer.add(row)
        versions_added.append(writer.commit({"stage": "test"}))
    lineage = {v["version"]: v["lineage"] for v in versions.list_versions(uri, store.FEATURES)}
    before: set = set()
    for v in versions_added:
        rows = store.read(uri, store.FEATURES, columns=["sample_id", "domain"], version=v).to_pylist()
        added = collections.Counter(r["domain"] for r in rows if r["sample_id"] not in before)
        assert lineage[v]["counts_per_domain"] == dict(added)
        before |= {r["sample_id"] for r in rows}


@pytest.mark.parametrize("storage", ["raw", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bytes_per_token_is_what_a_stored_row_holds_per_token(storage, dtype):
    """The stats' and lineage's bytes per token (and memfit's plan) are the encoded values' own
    bytes, fp8's per-token scales included; the capture window's are the engine's dtype."""
    m = dataclasses.replace(fs_helpers.meta(dtype=dtype, hidden=40, layer_ids=(1, 3, 6)), storage=storage)
    T = 7
    np_dtype = S._DTYPES[dtype]
    aux = np.ones((T, 3, 40), np.float32).astype(np_dtype)
    last = np.ones((T, 40), np.float32).astype(np_dtype)
    stored = len(S.encode_value(aux, m)) + len(S.encode_value(last, m))
    assert bytes_per_token(m) * T == stored
    assert captured_bytes_per_token(m) * T == aux.nbytes + last.nbytes


def test_a_nonfinite_bf16_value_is_found_and_no_finite_one_is():
    """``value_nonfinite`` on bf16 bit patterns against the values themselves (torch's bf16 widened to
    fp32): inf and NaN anywhere found, the largest finite magnitudes (exponent 0xFE) not."""
    import torch

    m = fs_helpers.meta(dtype="bfloat16", hidden=8)
    finite = torch.tensor([3.0e38, -2.5e38, 2.0 ** 127, -(2.0 ** 127), 1.0, 0.0, 1e-38, -7.5])
    rng = torch.Generator().manual_seed(0)
    for special in (None, float("inf"), float("-inf"), float("nan")):
        x = torch.cat([finite[None], torch.randn(4, 8, generator=rng) * 1e3])
        if special is not None:
            x[3, 5] = special
        bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        want = not bool(torch.isfinite(x.to(torch.bfloat16).float()).all())
        assert want is (special is not None)  # the reference sees the case: no overflow of the finite values
        assert S.value_nonfinite(bits.tobytes(), m) is want, special


def test_a_multi_turn_rows_loss_tokens_are_its_answers_tokens(tmp_path, tiny_target, monkeypatch):
    """The stored mask of a multi-turn conversation covers each answer the target gave (its end token
    included), and num_loss_tokens (what the trainer plans on) counts exactly those tokens."""
    monkeypatch.setattr(build, "Capturer", fs_helpers.StubCapturer)
    tok = AutoTokenizer.from_pretrained(tiny_target)
    conv = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"},
            {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "20"}]
    prompt = list(tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True)["input_ids"])
    response = tok.encode("20<|end|>", add_special_tokens=False)
    row = {**fs_helpers.prompt_rows(1, seed=7)[0], "mode": "chat", "messages_json": json.dumps(conv),
           "prompt_token_ids": prompt, "response_token_ids": response, "finish_reason": "stop"}
    uri = fs_helpers.prompts_store(tmp_path, [row], tiny_target)
    build.capture(target=str(tiny_target), store_uri=uri, cfg=CFG)
    got = store.read(uri, store.FEATURES, columns=["input_ids", "loss_mask", "num_loss_tokens"]).to_pylist()[0]
    first = tok.encode("2 + 3 = 5<|end|>", add_special_tokens=False)
    masked = [t for t, m in zip(got["input_ids"], got["loss_mask"]) if m]
    assert masked == first + response
    assert got["num_loss_tokens"] == len(first) + len(response)


def test_a_spooled_capture_is_read_back_as_its_aux_layers_and_the_last(tmp_path):
    """The read-back of a spooled capture (files as vLLM's connector writes them; no engine: only
    ``Capturer._read``): ``[T, aux + 1, H]`` splits into the aux layers in order and the last one,
    checked against the token ids and shape sent, and the file goes once read."""
    import torch
    from safetensors.torch import save_file

    cap = Capturer.__new__(Capturer)  # the read-back alone, no engine behind it
    cap.layer_ids, cap.capture_ids, cap.llm = (1, 3, 5), [1, 3, 5, 8], None
    T, H = 6, 10
    hs = torch.arange(T * 4 * H, dtype=torch.float32).reshape(T, 4, H)
    seq = list(range(100, 100 + T))

    def spooled(name: str, ids: list[int]):
        path = tmp_path / f"{name}.safetensors"
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(path))
        (tmp_path / f"{name}.safetensors.lock").write_text("")
        return SimpleNamespace(kv_transfer_params={"hidden_states_path": str(path)})

    aux, last = cap._read(seq, spooled("a", seq))
    np.testing.assert_array_equal(aux, hs[:, :3].numpy())
    np.testing.assert_array_equal(last, hs[:, 3].numpy())
    assert aux.flags.c_contiguous and last.flags.c_contiguous
    assert not (tmp_path / "a.safetensors").exists()
    with pytest.raises(StoreError, match="captured token ids differ from the sequence sent"):
        cap._read(seq, spooled("b", seq[::-1]))
    with pytest.raises(StoreError, match=r"captured shape \(6, 4, 10\) for 5 tokens, 4 layers"):
        cap._read(seq[:5], spooled("c", seq[:5]))


def test_a_weight_file_rewritten_in_place_is_hashed_again(tmp_path, tiny_target):
    """The per-process cache of weight hashes must not outlive the file's content: the same path and
    size rewritten (a fine-tune saved over the target) hashes as a fresh copy of it does."""
    target = tmp_path / "in place"
    shutil.copytree(tiny_target, target)
    before = identity.weights_hash(str(target))
    path = target / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    after = identity.weights_hash(str(target))
    fresh = tmp_path / "fresh copy"
    shutil.copytree(target, fresh)
    assert after != before and after == identity.weights_hash(str(fresh))
