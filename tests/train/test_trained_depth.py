"""A draft records the tokens a round it was trained to draft (EAGLE-3 ``ttt_steps``, P-EAGLE
``peagle.num_slots``, DFlash ``dflash.block_size`` - 1) in its exported config.json, both formats,
and serving it with more speculative tokens than that warns (the proposals past it come from
positions the draft never learnt). No engine is started."""

from __future__ import annotations

import json
import logging

import pytest

from eaglenest.engine import TRAINED_K, speculative_config, trained_depth
from eaglenest.serve.export import export_draft
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig, trained_num_speculative_tokens

SHAPES = {"eagle3": (TrainConfig(family="eagle3", ttt_steps=2), 2),
          "peagle": (TrainConfig(family="peagle", peagle=PEagleConfig(num_slots=2)), 2),
          "dflash": (TrainConfig(family="dflash", dflash=DFlashConfig(block_size=3, num_layers=1)), 2)}


def test_trained_tokens_per_family():
    assert trained_num_speculative_tokens({"family": "eagle3", "ttt_steps": 5}) == 5
    assert trained_num_speculative_tokens({"family": "peagle", "peagle": {"num_slots": 6}}) == 6
    assert trained_num_speculative_tokens({"family": "dflash", "dflash": {"block_size": 9}}) == 8
    assert trained_num_speculative_tokens({}) == TrainConfig.ttt_steps  # a checkpoint from before families


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("format", ["vllm", "speculators"])
def test_export_records_depth_and_serving_past_it_warns(tmp_path, tiny_target, synth, caplog, family, format):
    cfg, depth = SHAPES[family]
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "ckpt")
    draft = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=format)
    written = json.loads((draft / "config.json").read_text())
    assert written[TRAINED_K] == depth and trained_depth(written) == depth
    caplog.set_level(logging.WARNING, logger="eaglenest.engine")
    assert speculative_config(str(draft), depth)["num_speculative_tokens"] == depth
    assert not [r for r in caplog.records if "past the" in r.getMessage()]
    assert speculative_config(str(draft), depth + 2)["num_speculative_tokens"] == depth + 2
    warned = [r.getMessage() for r in caplog.records if "past the" in r.getMessage()]
    assert len(warned) == 1 and f"num_speculative_tokens {depth + 2} is past the {depth} tokens" in warned[0]


def test_export_with_k_past_depth_warns(tmp_path, tiny_target, synth, caplog):
    cfg, depth = SHAPES["peagle"]
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "ckpt")
    caplog.set_level(logging.WARNING, logger="eaglenest.serve.export")
    export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, num_speculative_tokens=depth + 1)
    assert any(f"{depth + 1} is past the {depth} tokens" in r.getMessage() for r in caplog.records)


def test_depth_of_older_and_foreign_drafts():
    """A DFlash config without the key reads its block size; an EAGLE-3 one without it is unknown (no
    warning); a bad value is ignored rather than trusted."""
    assert trained_depth({"dflash_config": {"mask_token_id": 1}, "block_size": 8}) == 7
    assert trained_depth({"speculators_model_type": "dflash", "block_size": 4}) == 3
    assert trained_depth({"architectures": ["LlamaForCausalLMEagle3"]}) is None
    assert trained_depth({TRAINED_K: True}) is None and trained_depth({TRAINED_K: "3"}) is None
    assert trained_depth({TRAINED_K: 0, "dflash_config": {}, "block_size": 5}) == 4
