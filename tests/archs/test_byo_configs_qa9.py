"""Targets a vLLM / Hugging Face user brings that no fixture names, walked through what each stage
reads from their config.json. No engine: capture's layer count and ids, the trainer's target config
and the export are compared with what transformers (and vLLM, which reads configs through it) make
of the same file.

* A multimodal wrapper written by transformers 4 (LLaVA-1.5 as released): its nested ``text_config``
  keeps only the keys that differ from ``LlamaConfig``'s defaults, so it names no hidden size, layer
  count or head count. transformers and vLLM take those from the class (4096, 32 layers, 32 heads);
  capture refused the target ("config has no num_hidden_layers") and the trainer read the wrapper.
* A draft's MLP activation: vLLM's draft layers (``LlamaForCausalLMEagle3``, DFlash's Qwen3) run silu
  only. The export wrote the *target's* ``hidden_act`` (Apertus: ``xielu``) whatever the draft was
  trained with, and a draft trained with another activation was exported for vLLM to refuse at engine
  start. A speculators export named the wrapper's text config as its verifier, not the model vLLM serves.
* A config.json without ``max_position_embeddings``: vLLM runs it at its class's default (Llama: 2048),
  while the stages kept their default engine length of 4096, which vLLM refused at engine start.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.build import target_facts
from eaglenest.featurestore.capture.engine import resolve_layer_ids
from eaglenest.ingest.commands import check_target_loads
from eaglenest.recipe import load_recipe
from eaglenest.serve.export import draft_hf_config, export_draft
from eaglenest.target import language_config, max_positions, nested_key, read_config
from eaglenest.train.model import DraftFlags, draft_config, draft_shape
from eaglenest.train.target import target_config

ROOT = Path(__file__).resolve().parent.parent.parent

#: llava-hf/llava-1.5-7b-hf's config.json as released (transformers 4.36), the vision tower trimmed.
LLAVA_15 = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
    "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_act": "quick_gelu", "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "layer_norm_eps": 1e-05, "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "max_position_embeddings", "rms_norm_eps")


def _write(tmp_path, cfg: dict):
    target = tmp_path / "llava 1.5"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(cfg))
    return target


@pytest.mark.parametrize("typed", [True, False], ids=["text_config_model_type", "wrapper_picks_llama"])
def test_a_transformers4_wrapper_text_config_is_read_with_its_class_defaults(tmp_path, typed):
    cfg = json.loads(json.dumps(LLAVA_15))
    if not typed:
        cfg["text_config"].pop("model_type")  # LlavaConfig then builds a LlamaConfig
    target = _write(tmp_path, cfg)
    hf = AutoConfig.from_pretrained(str(target)).get_text_config()
    assert (hf.hidden_size, hf.num_hidden_layers) == (4096, 32)  # what vLLM runs

    text = target_config(target)  # what the trainer and the export read
    assert {k: text[k] for k in SIZES} == {k: getattr(hf, k) for k in SIZES}
    assert nested_key(read_config(target)) == "text_config"
    assert text["torch_dtype"] == "float16" and text["tie_word_embeddings"] is False
    facts = target_facts(str(target))  # capture
    assert facts == {"num_layers": 32, "hidden_size": 4096, "dtype": "float16", "vocab_size": 32064}
    assert resolve_layer_ids((), facts["num_layers"]) == (2, 16, 29)
    assert max_positions(read_config(target)) == (4096, "max_position_embeddings=4096")
    shape = draft_shape(text)
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"],
            shape["intermediate_size"]) == (32, 32, 128, 11008)


def test_a_text_config_written_whole_is_read_as_written():
    text = {"model_type": "qwen3_vl_text", "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 1145, "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}}
    cfg = {"model_type": "qwen3_vl", "text_config": text, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    assert language_config(cfg) == {**text, "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_a_nested_dict_transformers_has_no_class_for_stays_the_wrapper():
    cfg = {"model_type": "no_such_wrapper", "hidden_size": 64, "text_config": {"model_type": "no_such_text"}}
    assert language_config(cfg) is cfg and nested_key(cfg) is None


#: Apertus (vLLM serves it with EAGLE-3): silu-free MLPs, hidden 128, 8 layers.
APERTUS = dict(model_type="apertus", hidden_act="xielu", hidden_size=128, intermediate_size=256, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=1141, rms_norm_eps=1e-6,
               max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def test_the_export_writes_the_activation_the_draft_was_trained_with():
    draft = draft_config(APERTUS, draft_vocab_size=64, layer_ids=(2, 4, 5), flags=DraftFlags()).to_dict()
    assert draft["hidden_act"] == "silu"  # the draft's own MLP, whatever the target's
    exported = draft_hf_config({"draft_config": draft, "layer_ids": [2, 4, 5]}, APERTUS, dtype="float32")
    assert exported["hidden_act"] == "silu"


def test_a_draft_trained_with_an_activation_vllm_cannot_serve_is_refused(tmp_path, toy_checkpoint, tiny_target):
    ckpt = tmp_path / "train"
    shutil.copytree(toy_checkpoint, ckpt)
    info = json.loads((ckpt / "checkpoint.json").read_text())
    info["draft_config"]["hidden_act"] = "xielu"  # as trained on an Apertus target
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError) as err:
        export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    msg = str(err.value)
    assert "draft_config.hidden_act is 'xielu'" in msg and "silu" in msg and "\n" not in msg, msg
    assert not (tmp_path / "draft").exists()


def test_a_speculators_export_names_the_wrapper_vllm_serves_as_its_verifier(tmp_path, toy_checkpoint, tiny_target):
    """The tiny target's language model inside a LLaVA-style wrapper: speculators' ``verifier`` is the model
    vLLM serves (``LlavaForConditionalGeneration``), not the text config's ``LlamaForCausalLM``."""
    target = tmp_path / "wrapped"
    shutil.copytree(tiny_target, target)
    text = json.loads((target / "config.json").read_text())
    wrapper = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
               "torch_dtype": text.get("torch_dtype", "float32")}
    (target / "config.json").write_text(json.dumps(wrapper))
    assert text["architectures"] == ["LlamaForCausalLM"]
    out = export_draft(toy_checkpoint, tmp_path / "spec", target_dir=target, format="speculators")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target), "architectures": ["LlavaForConditionalGeneration"]}


def test_a_config_without_max_position_embeddings_runs_at_its_class_default(tmp_path, tiny_target):
    """A hand-written Llama config.json without ``max_position_embeddings``: transformers, and vLLM
    through it, run it at ``LlamaConfig``'s 2048. The stages' default engine length (4096) was kept, and
    vLLM refused it at engine start; it now fits the target as for a config.json that says 2048, and a
    length the recipe gives past it is refused before any engine, naming the key."""
    target = tmp_path / "no max positions"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    assert cfg.pop("max_position_embeddings") > 4096
    (target / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(str(target)).max_position_embeddings == 2048  # what vLLM derives its limit from
    recipe = load_recipe(str(ROOT / "recipes" / "toy.yaml"), [f"run.target={target}"])
    assert [recipe.ingest.engine.max_model_len, recipe.featurestore.engine.max_model_len,
            recipe.evaluate.engine.max_model_len, recipe.serve.max_model_len] == [2048, 2048, 2048, 2048]
    with pytest.raises(ConfigError, match=r"^ingest\.engine\.max_model_len: 4096 is more than .*LlamaConfig's default "
                                          r"max_position_embeddings=2048.*set ingest\.engine\.max_model_len=2048"):
        check_target_loads(str(target), trust_remote_code=False, max_model_len=4096)
