"""The architecture builder (``eaglenest.tinytarget.archs``): shapes, kept token ids, the config keys
vLLM reads that ``save_pretrained`` drops, and determinism. No engine."""

from __future__ import annotations

import hashlib
import json

import pytest

from eaglenest.tinytarget import archs


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("built")
    return {a: archs.build(a, root / a) for a in archs.ARCHS}


def test_every_arch_has_the_shared_shape_and_tokenizer(built, tiny_target):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(str(tiny_target))
    for arch, path in built.items():
        cfg = json.loads((path / "config.json").read_text())
        text = cfg.get("text_config", cfg)
        tok = AutoTokenizer.from_pretrained(str(path))
        assert text["hidden_size"] == 128 and text["num_hidden_layers"] == 8, arch
        assert text["vocab_size"] == len(tok) >= len(base), arch
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0), arch
        assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (1, 2, 0), arch
        assert cfg["torch_dtype"] == cfg["dtype"] == archs.SPECS[arch].dtype, arch
        msgs = [{"role": "user", "content": "What is 2 + 2?"}]
        assert tok.apply_chat_template(msgs, add_generation_prompt=True) == \
            base.apply_chat_template(msgs, add_generation_prompt=True), arch


def test_config_keys_vllm_reads(built):
    ds = json.loads((built["deepseek_v3"] / "config.json").read_text())
    assert ds["topk_method"] == "noaux_tc" and ds["kv_lora_rank"] + ds["qk_rope_head_dim"] == 576
    mm = json.loads((built["minimax_m2"] / "config.json").read_text())
    assert (mm["rotary_dim"], mm["head_dim"], mm["scoring_func"], mm["use_routing_bias"]) == (16, 32, "sigmoid", True)
    llama = json.loads((built["llama_tied_bf16"] / "config.json").read_text())
    assert llama["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(built["llama_tied_bf16"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"


def test_build_is_deterministic(built, tmp_path):
    again = archs.build("qwen3_moe", tmp_path / "again")
    assert _sha(again / "model.safetensors") == _sha(built["qwen3_moe"] / "model.safetensors")
    other = archs.build("qwen3_moe", tmp_path / "other", seed=1)
    assert _sha(other / "model.safetensors") != _sha(built["qwen3_moe"] / "model.safetensors")


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'mamba'"):
        archs.build("mamba", tmp_path)
    assert archs.main(["mamba", str(tmp_path)]) == 2
