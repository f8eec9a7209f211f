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
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.engine import speculative_config
from eaglenest.errors import ConfigError
from eaglenest.serve.export import export_draft

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
    with pytest.raises(ConfigError, match="serve.format"):
        export_draft(trained.work / "train", tmp_path / "spec", target_dir=trained.target, format="speculators")


@pytest.mark.slow
def test_dflash_draft_served_lossless_above_the_floor_and_as_trained(trained):
    """Served AL above the floor, and vLLM's rounds equal the offline replay of its DFlash proposer with
    the train checkpoint (evaluate offline, fp32): the export carries the weights, layer offset, norms
    and non-causal block attention as trained (parity, round by round in total)."""
    report, offline = H.served_and_offline(trained)
    overall, off = report["overall"], offline["overall"]
    print(f"\nDFlash served AL {overall['acceptance_length']} over {overall['draft_rounds']} rounds, by position "
          f"{overall['acceptance_by_position']}; offline {off['acceptance_length']} over {off['draft_rounds']}")
    assert report["lossless"]["all_identical"], report["lossless"]
    assert overall["draft_rounds"] > 0 and overall["acceptance_length"] >= AL_FLOOR, overall
    assert (overall["draft_rounds"], overall["accepted_tokens"]) == (off["draft_rounds"], off["accepted_tokens"])
