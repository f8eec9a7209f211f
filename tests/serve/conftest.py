"""Serve tests reuse the train test helpers (loaded by path: tests are not packages), and stamp a
checkpoint with the feature identity of a target (the export's tokenizer checks)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def synth():
    path = Path(__file__).parent.parent / "train" / "synth.py"
    spec = importlib.util.spec_from_file_location("_eaglenest_test_synth_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def stamp_identity():
    """``stamp(ckpt_dir, target)``: checkpoint.json in ``ckpt_dir`` records features captured from ``target``
    (the tiny target's shapes: aux layers 2, 4, 5, hidden 64, fp32), as ``train run`` records them."""
    from eaglenest.featurestore.capture.identity import components

    def stamp(ckpt_dir: Path, target: Path) -> None:
        info = json.loads((ckpt_dir / "checkpoint.json").read_text())
        comps = components(target=str(target), layer_ids=[2, 4, 5], last_layer_id=8, dtype="float32",
                           storage="raw", sample_ids=["a"], gen_params_ids=["g"])
        info["feature_meta"] = {"target": str(target), "layer_ids": [2, 4, 5], "last_layer_id": 8,
                                "hidden_size": 64, "dtype": "float32", "identity": json.dumps(comps)}
        (ckpt_dir / "checkpoint.json").write_text(json.dumps(info))

    return stamp


@pytest.fixture(scope="session")
def dflash_bias_checkpoint(tmp_path_factory, synth):
    """A DFlash checkpoint of a target with MLP biases (the draft's own MLP is bias-free) and the target."""
    from eaglenest.train.config import DFlashConfig, TrainConfig

    work = tmp_path_factory.mktemp("dflash bias")
    target = synth.make_target(work / "target", mlp_bias=True)
    cfg = TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=1, block_size=3))
    return synth.untrained_checkpoint(cfg, target, work / "train"), target
