"""The exported draft directory matches what vLLM's EAGLE-3 loader expects (no engine started).

Names go through vLLM's own ``WeightsMapper`` of ``llama_eagle3.LlamaModel`` (an import, not an
engine); shapes and the config keys are checked against what ``Eagle3LlamaForCausalLM`` builds.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eaglenest.serve.export import export_draft
from eaglenest.train.checkpoint import save_checkpoint
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import build_draft
from eaglenest.train.target import load_target_tensors
from eaglenest.train.vocab import select_vocab


@pytest.fixture(params=[False, True], ids=["eagle3", "eagle3.1"])
def exported(request, tmp_path, synth):
    target = synth.make_target(tmp_path / "target")
    t = load_target_tensors(target)
    counts = torch.randint(0, 100, (2048,)).numpy()
    vocab = select_vocab(counts, 700)
    on = request.param
    cfg = TrainConfig(draft_vocab_size=700, norm_before_fc=on, fc_norm=on, norm_before_residual=on, norm_output=on)
    model = build_draft(cfg, t, layer_ids=(5, 2, 4), vocab=vocab, seed=0, sliding_window=64 if on else 0)
    save_checkpoint(tmp_path / "ckpt", model, info={"layer_ids": [2, 4, 5], "step": 0, "table_version": 1,
                                                    "store_uri": "s", "train_config": {"ttt_steps": 7}})
    out = export_draft(tmp_path / "ckpt", tmp_path / "draft", target_dir=target, dtype="bfloat16")
    return out, vocab, on, json.loads((target / "config.json").read_text())


def test_config_json(exported):
    out, vocab, on, tcfg = exported
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 2048 and cfg["draft_vocab_size"] == 700
    # vLLM's ids at the top level; the same layers as "output of block k" (id - 1) nested (serve/formats.py).
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "rms_norm_eps", "max_position_embeddings"):
        assert cfg[k] == tcfg[k], k
    assert cfg["target_hidden_size"] == tcfg["hidden_size"]
    assert all(cfg[f] is on for f in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"))
    assert cfg["torch_dtype"] == "bfloat16"
    # train.sliding_window: the layer type and window vLLM's Llama attention reads; absent otherwise.
    assert (cfg.get("layer_types"), cfg.get("sliding_window")) == ((["sliding_attention"], 64) if on else (None, None))
    assert (out / "README.md").is_file() and (out / "provenance.json").is_file()


def test_weights_match_vllm_loader(exported):
    from vllm.model_executor.models.llama_eagle3 import LlamaModel

    out, vocab, on, tcfg = exported
    H, I, V, VD = 128, 384, 2048, 700
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    # Emulate Eagle3LlamaForCausalLM.load_weights: skip t2d, d2t -> draft_id_to_target_id, "model."
    # prefix for all but lm_head, then LlamaModel's own mapper.
    mapped = {}
    for name, t in tensors.items():
        if "t2d" in name:
            continue
        if name == "d2t":
            mapped["draft_id_to_target_id"] = t
            continue
        if name.startswith("lm_head"):
            mapped[name] = t
            continue
        new = LlamaModel.hf_to_vllm_mapper._map_name(name)
        assert new is not None, name
        mapped.setdefault("model." + new, []).append(t) if "_proj" in new else mapped.__setitem__("model." + new, t)
    expected = {"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id",
                "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                "model.layers.0.input_layernorm.weight", "model.layers.0.hidden_norm.weight",
                "model.layers.0.post_attention_layernorm.weight"}
    if on:
        expected |= {"model.input_norm.weight", "model.fc_norm.0.weight", "model.fc_norm.1.weight",
                     "model.fc_norm.2.weight"}
    assert set(mapped) == expected
    qkv = mapped["model.layers.0.self_attn.qkv_proj.weight"]
    assert [q.shape for q in qkv] == [(H, 2 * H)] * 3
    assert [g.shape for g in mapped["model.layers.0.mlp.gate_up_proj.weight"]] == [(I, H)] * 2
    assert mapped["model.fc.weight"].shape == (H, 3 * H)
    assert mapped["lm_head.weight"].shape == (VD, H)
    assert all(t.dtype == torch.bfloat16 for k, t in tensors.items() if k not in ("d2t", "t2d"))
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (VD,) and t2d.dtype == torch.bool and t2d.shape == (V,)
    target_ids = torch.arange(VD) + d2t
    assert target_ids.tolist() == vocab.draft_ids.tolist()
    assert torch.equal(torch.nonzero(t2d).flatten(), target_ids)
    assert not any(k.startswith("embed_tokens") for k in tensors)
