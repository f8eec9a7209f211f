"""Target tensors of nested (multimodal) checkpoints, ``run.target_keys``, and the draft sizing
rule with its parameter count (defects 3 and 5 of issue 11)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.train.model import DraftFlags, DraftShape, Eagle3Draft, draft_config, draft_shape, num_parameters
from eaglenest.train.target import find_keys, load_target_tensors

LM = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("names,tied,want", [
    (LM + ["lm_head.weight"], False, ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")),
    (LM, True, ("model.embed_tokens.weight", "model.norm.weight", "model.embed_tokens.weight")),
    # Qwen3-VL / Mistral-3 / Gemma-3 (transformers 5 layout)
    (["model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
      "model.visual.blocks.0.norm1.weight", "model.visual.patch_embed.proj.weight", "model.visual.norm.weight",
      "lm_head.weight"], False,
     ("model.language_model.embed_tokens.weight", "model.language_model.norm.weight", "lm_head.weight")),
    # Llama-4 / older wrappers: language_model.model.*, language_model.lm_head
    (["language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
      "language_model.lm_head.weight", "vision_model.model.embed_tokens.weight",
      "multi_modal_projector.linear_1.weight"], False,
     ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
      "language_model.lm_head.weight")),
])
def test_keys_found_from_the_weight_map(names, tied, want):
    keys = find_keys(names, {"tie_word_embeddings": tied})
    assert (keys["embed"], keys["norm"], keys["lm_head"]) == want


def test_ambiguous_or_missing_keys_name_the_override():
    names = ["a.embed_tokens.weight", "b.embed_tokens.weight", "a.norm.weight", "lm_head.weight"]
    with pytest.raises(ConfigError, match=r"run.target_keys.embed"):
        find_keys(names, {})
    keys = find_keys(names, {}, overrides={"embed": "b.embed_tokens.weight", "norm": "a.norm.weight"})
    assert keys == {"embed": "b.embed_tokens.weight", "norm": "a.norm.weight", "lm_head": "lm_head.weight"}
    with pytest.raises(ConfigError, match=r"run.target_keys.norm: .* no tensor 'nope'"):
        find_keys(names, {}, overrides={"norm": "nope"})
    with pytest.raises(ConfigError, match="does not tie"):
        find_keys(LM, {"tie_word_embeddings": False})


def _nest(src, dst):
    """The tiny target re-packed as a multimodal wrapper: text_config, model.language_model.* weights
    and a (tiny) vision tower whose names would otherwise also match."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    state = load_file(str(src / "model.safetensors"))
    nested = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
              for k, v in state.items()}
    nested["model.visual.norm.weight"] = torch.zeros(16)
    nested["model.visual.embed_tokens.weight"] = torch.zeros(4, 16)
    save_file(nested, str(dst / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    cfg = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
           "torch_dtype": text.pop("torch_dtype", "float32"), "text_config": text,
           "vision_config": {"hidden_size": 16, "depth": 1}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_nested_checkpoint_gives_the_same_tensors(tmp_path, tiny_target):
    flat = load_target_tensors(tiny_target)
    nested = load_target_tensors(_nest(tiny_target, tmp_path / "vl"))
    assert nested["keys"] == {"embed": "model.language_model.embed_tokens.weight",
                              "norm": "model.language_model.norm.weight", "lm_head": "lm_head.weight"}
    for k in ("embed", "norm", "lm_head"):
        assert torch.equal(flat[k], nested[k])
    assert nested["config"]["hidden_size"] == flat["config"]["hidden_size"]  # text_config read
    assert nested["config"]["torch_dtype"] == flat["config"]["torch_dtype"]


def test_target_keys_override_reaches_training(tmp_path, tiny_target, capsys, one_row_features):
    """``run.target_keys.*`` reaches ``train run``: a wrong name is refused, naming the key; a valid one is
    the tensor the trained checkpoint records."""
    from eaglenest.pipeline.train_cli import main

    work = tmp_path / "run"
    one_row_features(str(work / "store"), tiny_target)
    base = ["run", f"run.workdir={work}", f"run.target={tiny_target}", "train.num_steps=1"]
    rc = main(base + ["run.target_keys.norm=model.nope"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "run.target_keys.norm:" in err and "no tensor 'model.nope'" in err
    assert not (work / "train" / "checkpoint.json").exists()
    # Not the tensor the name rule finds, so the checkpoint can only record it if the override reached training.
    norm = "model.layers.7.post_attention_layernorm.weight"
    found = load_target_tensors(tiny_target)["keys"]
    assert found["norm"] == "model.norm.weight" != norm
    rc = main(base + [f"run.target_keys.norm={norm}"])
    assert rc == 0, capsys.readouterr().err
    info = json.loads((work / "train" / "checkpoint.json").read_text())
    assert info["target_keys"] == {**found, "norm": norm}


# Hub shapes (config.json values of the released checkpoints).
DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                   num_key_value_heads=128, head_dim=64, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
                   vocab_size=129280, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=5e5)
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     vocab_size=151936, rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1e6)


def _params(cfg: dict, **kw) -> int:
    with torch.device("meta"):
        return num_parameters(Eagle3Draft(draft_config(cfg, draft_vocab_size=32000, layer_ids=(2, 30, 57),
                                                       flags=DraftFlags(), **kw)))


def test_sizing_rule_dense_mla_moe():
    assert draft_shape(LLAMA_8B) == {"intermediate_size": 14336, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "head_dim": 128}
    # MLA: head_dim is v_head_dim (transformers writes head_dim = qk_rope_head_dim = 64), at most 64 heads;
    # MoE: MLP 1.75 x hidden instead of the dense 18432.
    assert draft_shape(DEEPSEEK_V3) == {"intermediate_size": 12544, "num_attention_heads": 64,
                                        "num_key_value_heads": 64, "head_dim": 128}
    assert draft_shape(QWEN3_30B_A3B) == {"intermediate_size": 3584, "num_attention_heads": 32,
                                          "num_key_value_heads": 4, "head_dim": 128}
    assert draft_shape(DEEPSEEK_V3, DraftShape(intermediate_size=8192, num_attention_heads=32)) == {
        "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128}
    with pytest.raises(ConfigError, match="not a multiple"):
        draft_shape(LLAMA_8B, DraftShape(num_key_value_heads=5))


def test_deepseek_draft_parameters_follow_the_rule():
    H = 7168
    n = _params(DEEPSEEK_V3)
    # fc 3H*H, q/k/v 2H -> 64 heads x 128, o, MLP 3*H*12544, four norms, lm_head H x 32000 (draft vocab).
    assert n == 3 * H * H + 3 * 2 * H * 8192 + 8192 * H + 3 * H * 12544 + 4 * H + H * 32000
    copied = dict(DEEPSEEK_V3, kv_lora_rank=None, n_routed_experts=None)
    assert _params(copied) - n == 3 * H * (18432 - 12544)  # copying gave the dense 18432 MLP
    assert _params(LLAMA_8B) == 3 * 4096 * 4096 + 2 * 4096 * 4096 + 2 * 2 * 4096 * 1024 + 4096 * 4096 \
        + 3 * 4096 * 14336 + 4 * 4096 + 4096 * 32000
