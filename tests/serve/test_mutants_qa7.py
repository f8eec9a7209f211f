"""First-principles checks of the export's vocabulary maps and speculators config, written where a
plausible slip (a mutant of the code) left every earlier test passing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.evaluate.offline import _dflash_draft_config
from eaglenest.serve.draft_files import check_draft_dir, vocab_map_error
from eaglenest.serve.export import dflash_hf_config, draft_hf_config
from eaglenest.serve.formats import flat_tensors, speculators_config, speculators_tensors


def _maps(targets: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """d2t offsets (target = draft + d2t[draft]) and the t2d mask for draft ids mapped to ``targets``."""
    d2t = np.array(targets, dtype=np.int64) - np.arange(len(targets), dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[[t for t in targets if 0 <= t < vocab]] = True
    return d2t, t2d


def test_vocab_map_accepts_exactly_the_maps_vllm_serves_right():
    d2t, t2d = _maps([0, 3, 9], 10)
    assert vocab_map_error(d2t, 10, t2d) is None
    assert vocab_map_error(d2t, 10) is None
    # the last draft id at the vocabulary's end (id 10 of 0..9): vLLM would index past the target's logits
    d2t, t2d = _maps([0, 3, 10], 10)
    assert "outside the target's vocabulary 0..9" in vocab_map_error(d2t, 10, t2d)
    # two draft ids on one target id: that target token gets two logits, another none
    d2t, t2d = _maps([0, 3, 3], 10)
    assert vocab_map_error(d2t, 10) == "d2t maps two draft ids to the same target id"
    # t2d marking one target id more than d2t reaches
    d2t, t2d = _maps([0, 3, 9], 10)
    t2d[5] = True
    assert "t2d marks 4 target ids, d2t maps the draft's 3 to" in vocab_map_error(d2t, 10, t2d)


def _cfg(ids: list[int]) -> dict:
    return {"eagle_aux_hidden_state_layer_ids": ids, "torch_dtype": "float32", "draft_vocab_size": 8,
            "target_hidden_size": 4, "vocab_size": 16, "hidden_size": 4}


def test_speculators_config_says_how_many_aux_layers_fc_reads_when_not_three():
    # vLLM's llama_eagle3 sizes fc from num_aux_hidden_states (else 3): two aux layers must say so.
    two = speculators_config(_cfg([1, 2]), verifier="t", verifier_architectures=[], num_speculative_tokens=2)
    assert two["transformer_layer_config"]["num_aux_hidden_states"] == 2
    assert two["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    three = speculators_config(_cfg([1, 2, 3]), verifier="t", verifier_architectures=[], num_speculative_tokens=2)
    assert three["transformer_layer_config"].get("num_aux_hidden_states", 3) == 3


def _info(**draft) -> dict:
    d = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "draft_vocab_size": 64, "target_hidden_size": 128, "rms_norm_eps": 1e-6, **draft}
    return {"draft_config": d, "layer_ids": [2, 4, 5]}


TARGET = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8, "max_position_embeddings": 4096}


def test_exported_head_dim_is_the_drafts_own_when_it_names_one():
    # Qwen3-style heads: head_dim 64 with 4 heads over hidden 128 (not 128 / 4 = 32).
    assert draft_hf_config(_info(head_dim=64), TARGET, dtype="float32")["head_dim"] == 64
    assert draft_hf_config(_info(), TARGET, dtype="float32")["head_dim"] == 32


def test_dflash_export_writes_the_aux_layers_one_less_and_reads_them_back():
    info = _info(num_hidden_layers=2, dflash_block_size=4, mask_token_id=7, dflash=True)
    cfg = dflash_hf_config(info, TARGET, dtype="float32")
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 4]  # vLLM adds one back
    back = _dflash_draft_config(cfg, Path("draft"), "evaluate.draft", "redo")
    assert back["eagle_aux_layer_ids"] == [2, 4, 5] and back["mask_token_id"] == 7


def test_speculators_weight_names_round_trip():
    names = ["fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.input_layernorm.weight", "norm.weight",
             "lm_head.weight", "d2t", "t2d"]
    tensors = {n: torch.full((1,), float(i)) for i, n in enumerate(names)}
    spec = speculators_tensors(tensors)
    assert "layers.0.self_attn.q_proj.weight" in spec and not any(n.startswith("midlayer.") for n in spec)
    back = flat_tensors(spec)
    assert sorted(back) == sorted(names) and all(torch.equal(back[n], tensors[n]) for n in names)


def test_a_config_naming_fewer_aux_layers_than_fc_reads_is_refused(toy_export, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(toy_export, draft)
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"][:2]  # fc reads 3
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids: 2 aux layers"):
        check_draft_dir(draft)
