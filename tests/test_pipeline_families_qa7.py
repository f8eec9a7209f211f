"""QA repros, seventh pass, for served-AL selection across draft families (``pipeline/served_al.py``):
export settings a family's draft can never be exported with are refused when the scorer is built,
before training, not at the first snapshot ``train.select.every_steps`` steps into the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store
from eaglenest.pipeline.served_al import check_exportable, export_settings, served_al_scorer
from eaglenest.serve.config import ServeConfig
from eaglenest.serve.export import export_draft
from eaglenest.train.config import SelectConfig, TrainConfig

_spec = importlib.util.spec_from_file_location("_eaglenest_test_synth_qa7",
                                              Path(__file__).parent / "train" / "synth.py")
synth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synth)


def _heldout_store(uri: str) -> str:
    row = dict(sample_id="h0", domain="d", source="test", split="heldout", mode="chat",
               messages_json=json.dumps([{"role": "user", "content": "Hello."}]), prompt_token_ids=[],
               response_token_ids=[], finish_reason="", gen_params_id="g")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([row], schema=S.PROMPTS_SCHEMA))
    return uri


def test_selection_refuses_speculators_with_both_fc_norms_before_training(tmp_path, tiny_target):
    """``train run train.norm_before_fc=true train.fc_norm=true serve.format=speculators
    train.select.every_steps=N``: every snapshot's export is refused by speculators' layout, so the run
    trained N steps and then failed at its first snapshot. The scorer now refuses it when built."""
    train_cfg = TrainConfig(norm_before_fc=True, fc_norm=True, select=SelectConfig(every_steps=5))
    snapshot = synth.untrained_checkpoint(train_cfg, tiny_target, tmp_path / "select" / "snapshot")
    with pytest.raises(ConfigError, match="speculators refuses"):  # what the first snapshot met, steps in
        export_draft(snapshot, tmp_path / "select" / "draft", target_dir=tiny_target,
                     **export_settings(ServeConfig(format="speculators")))
    uri = _heldout_store(str(tmp_path / "store"))
    with pytest.raises(ConfigError) as err:
        served_al_scorer(train_cfg, None, target_dir=str(tiny_target), store_uri=uri,
                         serve_cfg=ServeConfig(format="speculators"))
    assert str(err.value).startswith("serve.format: speculators refuses train.norm_before_fc together with "
                                     "train.fc_norm"), str(err.value)
    assert "\n" not in str(err.value) and "serve.format=vllm" in str(err.value)
    # the vLLM format exports that draft, and a speculators export of a draft with one of the norms too
    assert callable(served_al_scorer(train_cfg, None, target_dir=str(tiny_target), store_uri=uri,
                                     serve_cfg=ServeConfig()))
    one = TrainConfig(fc_norm=True, select=SelectConfig(every_steps=5))
    assert callable(served_al_scorer(one, None, target_dir=str(tiny_target), store_uri=uri,
                                     serve_cfg=ServeConfig(format="speculators")))


def test_selection_refuses_fp8_for_a_dflash_draft_where_snapshots_are_exported_fp8():
    """A DFlash run with ``serve.quantization=fp8`` on a CUDA machine (where snapshots are exported
    quantised) failed at its first snapshot; on a CPU its snapshots are scored unquantised, as before."""
    dflash = TrainConfig(family="dflash", select=SelectConfig(every_steps=5))
    with pytest.raises(ConfigError, match=r"^serve\.quantization: a DFlash draft \(train\.family=dflash\)"):
        check_exportable(dflash, {"quantization": "fp8", "format": "vllm"})
    check_exportable(dflash, {"quantization": "none", "format": "vllm"})
    check_exportable(TrainConfig(select=SelectConfig(every_steps=5)), {"quantization": "fp8", "format": "vllm"})
