"""DFlash (train.family=dflash) exported in vLLM's flat DFlash format and served by real vLLM.

The export: ``DFlashDraftModel`` with a qwen3 config (explicit head_dim, block_size,
``dflash_config`` {mask_token_id, target_layer_ids = aux ids - 1, causal: false}), weights
``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``; every caller's speculative config says
``method: dflash``. Served: the tiny target's store written without an engine (its own greedy
answers, features from a transformers forward: tests/archs/arch_helpers.py), a short ``train run``
with ``train.family=dflash``, ``serve export``, ``evaluate al``: every output token-identical to
the target alone, vLLM's rounds equal to the offline replay of the trained checkpoint (evaluate
offline replays vLLM's DFlash proposer; a block-causal export is caught by it), and served AL above
what a garbage draft gets (the same export with every
floating weight replaced by noise of its own scale serves AL 1.025 on these prompts, measured).

DFlash learns slowly at first on this toy (its block reads the context through attention only):
60 steps give served AL 1.10, so this test trains 240 (served AL 1.22, equal to the offline replay;
docs/training.md). The draft's two layers share one k_norm: vLLM 0.32 on CPU norms every layer's
context keys with layer 0's, which this parity check caught (docs/serve.md, "DFlash drafts").

Also exported in speculators' layout (``serve.format=speculators``), with
``sliding_window_non_causal: true``: vLLM sets ``dflash_config.causal`` to its negation and
speculators' default (false) would serve the block causal. Served as trained is shown by ``evaluate
parity`` (every proposal vLLM makes from the export, round by round, is the train checkpoint's); on
this weak draft the served AL does not move with the flag (measured), so parity is also what tells
the wrong flag apart: it fails, naming where the block-causal proposals part.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.engine import speculative_config
from eaglenest.errors import ConfigError
from eaglenest.serve.export import export_draft
from eaglenest.train.checkpoint import read_info
from eaglenest.train.config import recommended_num_speculative_tokens

_spec = importlib.util.spec_from_file_location(
    "_eaglenest_test_arch_helpers_dflash", Path(__file__).parent.parent / "archs" / "arch_helpers.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

#: Served AL the trained DFlash draft must reach (measured: 1.2212 after 240 steps; garbage: 1.0248).
AL_FLOOR = 1.12
DFLASH = {"num_steps": 240, "log_every_steps": 30, "family": "dflash",
          "dflash": {"num_layers": 2, "block_size": 4, "anchors_per_row": 32}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target):
    """The tiny target's store (no engine) and a DFlash draft trained on it and exported."""
    base = H.Run("tiny", tmp_path_factory.mktemp("dflash-store"), target=tiny_target)
    H.write_prompts(base.store, base.target, on_policy=True)
    H.hf_features(base.store, base.target, layer_ids=(2, 4, 5))
    run = H.Run("tiny", tmp_path_factory.mktemp("dflash"), train={**H.SERVED_TRAIN, **DFLASH},
                target=base.target, store=base.store)
    assert run.cli("train", "run") == 0 and run.cli("serve", "export") == 0
    return run


def test_export_is_the_flat_dflash_format(trained, tmp_path):
    draft = trained.work / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 3, 4], "causal": False,
                                    "use_aux_hidden_state": True}  # aux ids (2, 4, 5) - 1; the pad id
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 4 and cfg["head_dim"] == 32
    assert cfg["layer_types"] == ["full_attention"] * 2 and "eagle_aux_hidden_state_layer_ids" not in cfg
    weights = load_file(str(draft / "model.safetensors"))
    ckpt = load_file(str(trained.work / "train" / "draft.safetensors"))
    assert weights["fc.weight"].shape == (cfg["hidden_size"], 3 * cfg["target_hidden_size"])
    for name in ("hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight", "lm_head.weight"):
        assert torch.equal(weights[name], ckpt[name].to(weights[name].dtype)), name
    assert not any(n.startswith(("midlayer.", "embed_tokens.")) for n in weights)
    # One k_norm shared by the layers (vLLM-CPU applies layer 0's to every layer's context keys).
    assert torch.equal(weights["layers.0.self_attn.k_norm.weight"], weights["layers.1.self_attn.k_norm.weight"])
    assert speculative_config(str(draft), 3) == {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    assert "DFlashDraftModel" in (draft / "README.md").read_text()
    with pytest.raises(ConfigError, match="serve.quantization"):  # FP8 DFlash is not written yet
        export_draft(trained.work / "train", tmp_path / "fp8", target_dir=trained.target, quantization="fp8")
    assert not (tmp_path / "fp8").exists()


@pytest.mark.slow
def test_dflash_draft_served_lossless_above_the_floor_and_as_trained(trained):
    """Served AL above the floor, and vLLM's rounds equal the offline replay of its DFlash proposer with
    the train checkpoint (evaluate offline, fp32): the export carries the weights, layer offset, norms
    and non-causal block attention as trained (parity, round by round in total)."""
    H.assert_served_as_trained(trained, "DFlash", AL_FLOOR)


def test_dflash_speculators_export_as_vllm_reads_it(trained, tmp_path):
    draft = H.speculators_export(trained, tmp_path)
    raw = json.loads((draft / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["architectures"] == ["DFlashSpeculator"]
    assert raw["sliding_window_non_causal"] is True and raw["aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "is_causal" not in raw["transformer_layer_config"]
    target, spec, hf = H.as_vllm_reads_it(draft)
    # K: what the export states (its proposal; the family's recommended K for this checkpoint) is what vLLM drafts.
    k = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == recommended_num_speculative_tokens(read_info(trained.work / "train")["train_config"]) == 3
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == k
    assert Path(target) == Path(trained.target)
    flat = json.loads((trained.work / "draft" / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and raw["transformer_layer_config"]["model_type"] == "qwen3"
    assert hf["dflash_config"]["causal"] is False  # served non-causal in the block, as trained
    assert hf["dflash_config"]["target_layer_ids"] == flat["dflash_config"]["target_layer_ids"]
    assert hf["dflash_config"]["mask_token_id"] == flat["dflash_config"]["mask_token_id"]
    for key in ("num_hidden_layers", "head_dim", "layer_types", "draft_vocab_size", "target_hidden_size"):
        assert hf[key] == flat[key], key
    assert speculative_config(str(draft), 3) == {"method": "dflash", "model": str(draft), "num_speculative_tokens": 3}
    ours, theirs = load_file(str(draft / "model.safetensors")), load_file(str(trained.work / "draft" /
                                                                            "model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(t, theirs[n]) for n, t in ours.items())
    assert "sliding_window_non_causal: true" in (draft / "README.md").read_text()


@pytest.mark.slow
def test_dflash_speculators_export_served_as_trained_and_the_causal_flag_matters(trained, tmp_path):
    draft = H.speculators_export(trained, tmp_path)
    # The same export with speculators' default flag: vLLM serves the block causal. On this weak draft
    # that leaves the served AL as it was (measured: 104 rounds, 20 accepted either way), so whether
    # the block is served as trained is seen where the proposals part: ``evaluate parity`` against the
    # train checkpoint, every proposal identical for the export, not for the wrong flag.
    causal = tmp_path / "causal"
    shutil.copytree(draft, causal)
    cfg = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**cfg, "sliding_window_non_causal": False}))
    assert H.as_vllm_reads_it(causal)[2]["dflash_config"]["causal"] is True
    (code, same), (wrong_code, parted) = (H.parity(trained, d, tmp_path / f"parity-{d.name}")
                                                  for d in (draft, causal))
    print(f"parity: export {same['identical_by_position']} over {same['rounds']} rounds; with "
          f"sliding_window_non_causal false {parted['identical_by_position']}, first {parted['first_difference']}")
    assert code == 0 and same["passed"], same["first_difference"]
    assert same["rounds"] >= 20 and same["identical_by_position"] == [1.0] * same["num_speculative_tokens"]
    assert wrong_code == 1 and not parted["passed"] and parted["first_difference"] is not None
    assert parted["first_difference"]["trained_token"] != parted["first_difference"]["served_token"]
