"""What each reader finds in an export (no engine started): vLLM's own config readers are run on the
files; speculators' rules are stated from its source (serve/formats.py says where). No SGLang claim
is made or tested: its loader does not run here (docs/serve.md).

Aux ids (1, 3, 6) differ from vLLM's default for the 8-layer target (2, 4, 5), so a reader that fell
back to its default would be caught.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.errors import ConfigError
from eaglenest.serve.export import export_draft

IDS = [1, 3, 6]


@pytest.fixture(scope="module", params=[False, True], ids=["eagle3", "eagle3.1-window"])
def drafts(request, tmp_path_factory, synth):
    from eaglenest.train.checkpoint import save_checkpoint
    from eaglenest.train.config import TrainConfig
    from eaglenest.train.loop import build_draft
    from eaglenest.train.target import load_target_tensors
    from eaglenest.train.vocab import select_vocab

    on = request.param
    tmp = tmp_path_factory.mktemp("formats")
    target = synth.make_target(tmp / "target")
    vocab = select_vocab(torch.randint(0, 100, (2048,)).numpy(), 700)
    cfg = TrainConfig(draft_vocab_size=700, fc_norm=on, norm_before_residual=on, norm_output=on)
    model = build_draft(cfg, load_target_tensors(target), layer_ids=tuple(IDS), vocab=vocab, seed=0,
                        sliding_window=64 if on else 0)
    save_checkpoint(tmp / "ckpt", model, info={"layer_ids": IDS, "step": 5, "table_version": 3, "store_uri": "s",
                                               "train_config": {}})
    out = {fmt: export_draft(tmp / "ckpt", tmp / fmt, target_dir=target, dtype="bfloat16", format=fmt,
                             num_speculative_tokens=4)
           for fmt in ("vllm", "speculators")}
    return out, target, on


def _runner_ids(hf_config):
    """The aux ids vLLM's CPU/GPU model runner (v1) and model runner v2 take from a draft config."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    return v1, get_eagle3_aux_layers_from_config(spec)


def test_vllm_format_every_reader_finds_the_layers(drafts):
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    out, _, on = drafts
    raw = json.loads((out["vllm"] / "config.json").read_text())
    # vLLM: loads the directory as vLLM's SpeculativeConfig does (EAGLEConfig around the Llama config).
    hf = EAGLEConfig(get_config(str(out["vllm"]), trust_remote_code=False), method="eagle3", model_type="eagle")
    assert hf.architectures == ["LlamaForCausalLMEagle3"]
    assert _runner_ids(hf) == (tuple(IDS), tuple(IDS))
    assert len(hf.eagle_config["eagle_aux_hidden_state_layer_ids"]) == 3  # llama_eagle3: fc width
    assert (getattr(hf, "layer_types", None), getattr(hf, "sliding_window", None)) == \
        ((["sliding_attention"], 64) if on else (None, None))
    # The nested list names the same layers as "output of block k" (id - 1); vLLM reads its length only.
    assert [i + 1 for i in raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == IDS
    # An export from before the top-level key (vLLM ids nested only) still resolves in vLLM's v1 runner.
    old = {k: v for k, v in raw.items() if k != "eagle_aux_hidden_state_layer_ids"}
    old["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": IDS, "use_aux_hidden_state": True}
    assert _runner_ids(SimpleNamespace(**old))[0] == tuple(IDS)


def test_speculators_format_as_vllm_reads_it(drafts):
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators

    out, target, on = drafts
    spec_dir = str(out["speculators"])
    raw = json.loads((out["speculators"] / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3" and raw["architectures"] == ["Eagle3Speculator"]
    assert "model_type" not in raw and raw["transformer_layer_config"]["model_type"] == "llama"
    # `vllm serve <dir>`: the target and the speculative config come from the draft's config.json.
    model, tokenizer, spec = maybe_override_with_speculators(spec_dir, None, trust_remote_code=False)
    assert (model, tokenizer) == (str(target), str(target))
    assert spec == {"method": "eagle3", "num_speculative_tokens": 4, "model": spec_dir}
    hf = get_config(spec_dir, trust_remote_code=False)
    assert type(hf).__name__ == "SpeculatorsConfig" and hf.architectures == ["Eagle3LlamaForCausalLM"]
    assert _runner_ids(hf) == (tuple(IDS), tuple(IDS))
    vllm_cfg = json.loads((out["vllm"] / "config.json").read_text())
    for key in ("draft_vocab_size", "target_hidden_size", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                "rope_parameters", "norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"):
        assert getattr(hf, key) == vllm_cfg[key], key
    assert (getattr(hf, "layer_types", None), getattr(hf, "sliding_window", None)) == \
        ((["sliding_attention"], 64) if on else (None, None))
    # Same tensors, speculators' names: the decoder block is layers.0 (vLLM maps both to the same params).
    from vllm.model_executor.models.llama_eagle3 import LlamaModel

    a, b = load_file(str(out["vllm"] / "model.safetensors")), load_file(str(out["speculators"] / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): t for k, t in a.items()}
    assert renamed.keys() == b.keys() and all(torch.equal(renamed[k], b[k]) for k in b)
    assert any(k.startswith("layers.0.") for k in b) and not any(k.startswith("midlayer.") for k in b)
    for k in a:
        assert LlamaModel.hf_to_vllm_mapper._map_name(k) == LlamaModel.hf_to_vllm_mapper._map_name(
            k.replace("midlayer.", "layers.0.")), k


def test_window_reader_warnings_and_card(drafts, caplog, tmp_path):
    out, target, on = drafts
    card = (out["vllm"] / "README.md").read_text()
    assert "## Readers" in card and "[0, 2, 5]" in card  # the nested ids, stated
    assert "SGLang" not in card.replace("Other readers (SGLang) are not tested", "")  # no SGLang claim
    assert '--algorithm-kwargs \'{"eagle_aux_hidden_state_layer_ids": [1, 3, 6]' in card
    with caplog.at_level(logging.WARNING, logger="eaglenest.serve.export"):
        export_draft(out["vllm"].parent / "ckpt", tmp_path / "again", target_dir=target)
    warned = [r.getMessage() for r in caplog.records]
    window = [w for w in warned if "sliding window" in w or "sliding_window" in w]
    if on:  # speculators convert cannot represent the window: the log and the card say so
        assert any(w.startswith("speculators convert: drops layer_types/sliding_window") for w in window)
        assert "drops layer_types/sliding_window" in card
        assert "| sliding window | 64 tokens |" in card
    else:
        assert not window and "| sliding window | none (full attention) |" in card
    spec_card = (out["speculators"] / "README.md").read_text()
    assert 'LLM(model="<this directory>")' in spec_card and "SGLang" not in spec_card


def test_speculators_format_errors(drafts, tmp_path, root):
    out, target, _ = drafts
    ckpt = out["vllm"].parent / "ckpt"
    with pytest.raises(ConfigError, match="serve.format"):
        export_draft(ckpt, tmp_path / "x", target_dir=target, format="speculators", quantization="fp8")
    from eaglenest.recipe import load_recipe

    with pytest.raises(ConfigError, match="serve.format"):
        load_recipe(root / "recipes/toy.yaml", ["serve.format=speculators", "serve.quantization=fp8"])
    with pytest.raises(ConfigError, match="serve.format"):
        load_recipe(root / "recipes/toy.yaml", ["serve.format=onnx"])
    assert load_recipe(root / "recipes/toy.yaml", ["serve.format=speculators"]).serve.format == "speculators"


def test_speculators_refuses_both_input_norms():
    from eaglenest.serve import formats

    cfg = {"norm_before_fc": True, "fc_norm": True, "eagle_aux_hidden_state_layer_ids": IDS}
    with pytest.raises(ConfigError, match="norm_before_fc together with fc_norm"):
        formats.speculators_config(cfg, verifier="t", verifier_architectures=[], num_speculative_tokens=3)


def test_cli_export_speculators(drafts, root):
    from eaglenest.serve.cli import main

    out, target, _ = drafts
    work = out["vllm"].parent
    assert main(["export", "--recipe", str(root / "recipes/toy.yaml"), f"run.workdir={work}", f"run.target={target}",
                 "serve.checkpoint_subdir=ckpt", "serve.draft_subdir=cli", "serve.format=speculators",
                 "serve.num_speculative_tokens=5"]) == 0
    raw = json.loads((work / "cli" / "config.json").read_text())
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    prov = json.loads((work / "cli" / "provenance.json").read_text())
    assert prov["format"] == "speculators" and prov["config"]["serve"]["format"] == "speculators"
    assert prov["inputs"]["table"] == "features" and prov["inputs"]["version"] == 3
