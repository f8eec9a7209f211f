"""QA 11 of the parallel drafters' exports: what the installed vLLM reads from each family's export,
checked with vLLM's own config code (no engine), against what the draft was trained with."""

from __future__ import annotations

import copy
import json

import pytest

from eaglenest.serve.export import export_draft
from eaglenest.train.config import PEagleConfig, TrainConfig


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
@pytest.mark.parametrize("flag", ["fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"])
def test_vllm_reads_every_eagle31_flag_of_a_speculators_export(tmp_path, synth, tiny_target, family, flag):
    """A P-EAGLE draft trained with ``train.fc_norm`` or ``train.norm_output`` and exported with
    ``serve.format=speculators``: vLLM 0.32's ``peagle`` config updater copies only
    ``norm_before_residual`` and ``norm_before_fc`` from the top level, so vLLM built the draft without
    its per-layer fc norms (or fed the prenorm output forward): served, silently, not as trained."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = TrainConfig(family=family, draft_vocab_size=16, ttt_steps=2,
                      peagle=PEagleConfig(num_slots=2, mask_token_id=7), **{flag: True})
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format="speculators")
    written = json.loads((out / "config.json").read_text())
    assert written[flag] is True
    read = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(written))
    for name in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"):
        assert bool(read.get(name)) == (name == flag), name  # what vLLM's llama_eagle3 builds the draft with
    assert SpeculatorsConfig.build_vllm_speculative_config(written)["method"] == "eagle3"
    assert read.get("pard_token") == (7 if family == "peagle" else None)  # vLLM's parallel-drafting token


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_reads_a_dflash_export_as_trained(tmp_path, synth, tiny_target, fmt):
    """Every key of a DFlash export the installed vLLM reads, read by vLLM's own config code: the block
    is non-causal in every layer (as trained), the aux layers are the trained ones, the mask token is
    the trained one, and so are the shapes (no engine: vLLM's config loader and its helpers)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal, dflash_has_any_non_causal
    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from eaglenest.train.checkpoint import read_info
    from eaglenest.train.config import DFlashConfig

    cfg = TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=2, block_size=3))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    info = read_info(ckpt)
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=fmt)
    assert json.loads((out / "config.json").read_text())["block_size"] == 3  # the depth trained (K <= 2)
    read = get_config(str(out), trust_remote_code=False)
    n = read.num_hidden_layers
    assert n == 2 and read.model_type == ("speculators" if fmt == "speculators" else "qwen3")
    assert not any(_dflash_layer_causal(read, i) for i in range(n)) and dflash_has_any_non_causal(read)
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=read))
    assert list(get_eagle3_aux_layers_from_config(spec)) == sorted(info["layer_ids"])
    assert read.dflash_config["mask_token_id"] == info["draft_config"]["mask_token_id"]
    d = info["draft_config"]
    for key in ("target_hidden_size", "head_dim", "hidden_size", "draft_vocab_size", "num_key_value_heads",
                "intermediate_size", "rms_norm_eps"):
        assert getattr(read, key) == d[key], key


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("family, depth", [("peagle", 4), ("dflash", 5), ("eagle3", 5)])
def test_the_export_records_the_depth_trained_apart_from_the_k_recommended(tmp_path, synth, tiny_target, fmt,
                                                                           family, depth):
    """``trained_num_speculative_tokens`` is the depth the draft was trained for (P-EAGLE ``num_slots``,
    DFlash ``block_size`` - 1, EAGLE-3 ``ttt_steps``), not the family's recommended K: serving warns past it."""
    from eaglenest.engine import TRAINED_K, draft_num_speculative_tokens
    from eaglenest.train.config import BEST_NUM_SPECULATIVE_TOKENS, DFlashConfig

    cfg = TrainConfig(family=family, ttt_steps=5, peagle=PEagleConfig(num_slots=4),
                      dflash=DFlashConfig(num_layers=1, block_size=6))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=fmt)
    written = json.loads((out / "config.json").read_text())
    assert written[TRAINED_K] == depth
    assert draft_num_speculative_tokens(str(out), 99) == min(BEST_NUM_SPECULATIVE_TOKENS[family], depth)
