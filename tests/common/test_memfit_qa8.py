"""memfit's weights: what vLLM loads, counted once (a target folder may also ship a consolidated copy)."""

from __future__ import annotations

import json

import pytest

from eaglenest import memfit
from eaglenest.errors import ConfigError

DIMS = {"layers": 2, "hidden": 64, "heads": 4, "head_dim": 16, "kv_heads": 2, "intermediate": 128, "vocab": 256,
        "dtype_bytes": 2}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "vocab_size": 256, "dtype": "bfloat16"}


def _sharded_with_consolidated_copy(folder, shard_bytes=(3000, 5000)):
    """A Mistral-style folder: sharded weights under an index, and the same weights once more in
    ``consolidated.safetensors`` (for mistral-inference), which vLLM does not load."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    names = [f"model-{i + 1:05d}-of-{len(shard_bytes):05d}.safetensors" for i in range(len(shard_bytes))]
    for name, n in zip(names, shard_bytes):
        (folder / name).write_bytes(b"\0" * n)
    (folder / "consolidated.safetensors").write_bytes(b"\0" * sum(shard_bytes))
    weight_map = {f"model.layers.{i}.w": name for i, name in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_a_consolidated_copy_beside_indexed_shards_is_not_counted(tmp_path):
    """vLLM loads the files of the index's weight map only; counting the consolidated copy too doubled the
    weights, and a target that fits was refused (the estimates promise never to refuse what runs)."""
    target = _sharded_with_consolidated_copy(tmp_path / "mistral like")
    assert memfit.weights_bytes(str(target), DIMS) == 3000 + 5000


def test_without_an_index_every_safetensors_file_counts(tmp_path):
    target = tmp_path / "t"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"\0" * 1234)
    (target / "extra.safetensors").write_bytes(b"\0" * 766)
    assert memfit.weights_bytes(str(target), DIMS) == 2000


def test_a_folder_without_weights_gets_the_dense_estimate_from_first_principles(tmp_path):
    h, d, L = DIMS["hidden"], DIMS["head_dim"], DIMS["layers"]
    attn = h * d * DIMS["heads"] * 2 + h * d * DIMS["kv_heads"] * 2  # q, o; k, v
    mlp = 3 * h * DIMS["intermediate"]  # gate, up, down
    embed_and_head = 2 * DIMS["vocab"] * h
    assert memfit.weights_bytes(str(tmp_path), DIMS) == (L * (attn + mlp) + embed_and_head) * 2


def test_the_engine_check_is_sized_by_the_loaded_shards_alone(tmp_path, monkeypatch):
    """The same refusal end to end: memory for the shards (and the small KV and activations) but not for
    the consolidated copy as well."""
    target = _sharded_with_consolidated_copy(tmp_path / "t", shard_bytes=(4 << 20, 4 << 20))
    monkeypatch.setattr(memfit, "available_bytes", lambda: 12 << 20)
    memfit.check_engine(str(target), tokens=16, engine_dtype="auto", key="ingest.max_model_len", what="a chat")
    monkeypatch.setattr(memfit, "available_bytes", lambda: 7 << 20)
    with pytest.raises(ConfigError, match=r"^ingest\.max_model_len: a chat needs about 0\.01 GiB"):
        memfit.check_engine(str(target), tokens=16, engine_dtype="auto", key="ingest.max_model_len", what="a chat")


@pytest.mark.parametrize("checkpoint,engine,share", [
    ("float32", "bfloat16", 0.5), ("float32", "float16", 0.5), ("float32", "auto", 1.0), ("float32", "float32", 1.0),
    ("bfloat16", "auto", 1.0), ("bfloat16", "float32", 1.0),  # an upcast: the file size stays a lower bound
])
def test_weights_are_counted_in_the_dtype_the_engine_loads_them_in(tmp_path, checkpoint, engine, share):
    """A float32 checkpoint served in bfloat16 (``*.engine.dtype=bfloat16``) holds half its file size in
    memory: counting the file size refused targets that fit (the estimates are lower bounds)."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**CONFIG, "dtype": checkpoint}))
    (target / "model.safetensors").write_bytes(b"\0" * 4000)
    dims = memfit.target_dims({**CONFIG, "dtype": checkpoint}, engine_dtype=engine)
    assert memfit.weights_bytes(str(target), dims) == int(4000 * share)
