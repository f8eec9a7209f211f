"""Fixtures for the train tests: helper modules loaded by path, a random tiny target, features."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def load_helper(name: str):
    spec = importlib.util.spec_from_file_location(f"_eaglenest_test_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def wandb_log():
    """wandb_log.records(run_file): the records of a W&B offline run file."""
    return load_helper("wandb_log")


@pytest.fixture(scope="session")
def synth():
    return load_helper("synth")


@pytest.fixture(scope="session")
def reference():
    return load_helper("reference_ttt")


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory, synth):
    return synth.make_target(tmp_path_factory.mktemp("target") / "tiny-target")


@pytest.fixture(scope="session")
def feature_store(tmp_path_factory, synth, tiny_target):
    """A store with 24 greedy samples (prompt 8, response 24) and 4 held-out ones."""
    uri = str(tmp_path_factory.mktemp("store") / "store")
    samples = synth.greedy_sequences(tiny_target, n=28, prompt_len=8, gen_len=24)
    synth.write_features(uri, tiny_target, samples[:24])
    version = synth.write_features(uri, tiny_target, samples[24:], split="heldout")
    return uri, version


@pytest.fixture(scope="module")
def peagle_draft(tmp_path_factory, synth, tiny_target):
    """An untrained 2-slot P-EAGLE draft (best/ selection tests mark its weights by step)."""
    from eaglenest.train.checkpoint import load_checkpoint
    from eaglenest.train.config import PEagleConfig, TrainConfig

    cfg = TrainConfig(family="peagle", draft_vocab_size=16, peagle=PEagleConfig(num_slots=2))
    return load_checkpoint(synth.untrained_checkpoint(cfg, tiny_target, tmp_path_factory.mktemp("pe") / "c"))[0]


@pytest.fixture(scope="session")
def at_step():
    """``at_step(draft, step)``: ``draft`` with its weights marked by ``step`` (fc.weight[0, 0] = step)."""
    def mark(draft, step: int):
        import torch

        with torch.no_grad():
            draft.fc.weight[0, 0] = float(step)
        return draft

    return mark
