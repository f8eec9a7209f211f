"""End-to-end trainer on synthetic features: loss goes down, runs are reproducible, checkpoints round-trip."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.capture.identity import weights_hash
from eaglenest.train.checkpoint import load_checkpoint
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import lr_factor, train

FAST = dict(draft_vocab_size=512, ttt_steps=3, pack_tokens=128, batch_rows=2, warmup_steps=5,
            log_every_steps=5, lr=5e-3)


def run(tmp_path, store, target, name, **kw):
    uri, _ = store
    cfg = TrainConfig(**{**FAST, **kw})
    return train(cfg, store_uri=uri, workdir=str(tmp_path / name), target_dir=str(target), seed=0, argv=["test"])


@pytest.mark.slow
def test_training_reduces_loss_and_is_deterministic(tmp_path, feature_store, tiny_target):
    a = run(tmp_path, feature_store, tiny_target, "a", num_epochs=6)
    lines = [json.loads(x) for x in (a.outdir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) >= 4
    assert lines[-1]["loss"] < 0.7 * lines[0]["loss"], (lines[0]["loss"], lines[-1]["loss"])
    assert lines[-1]["step_acc"][0] > lines[0]["step_acc"][0]
    b = run(tmp_path, feature_store, tiny_target, "b", num_epochs=6)
    wa, wb = load_file(a.outdir / "draft.safetensors"), load_file(b.outdir / "draft.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = run(tmp_path, feature_store, tiny_target, "c", num_epochs=6, seed=1)
    assert not torch.equal(wa["fc.weight"], load_file(c.outdir / "draft.safetensors")["fc.weight"])


def test_checkpoint_round_trip_and_provenance(tmp_path, feature_store, tiny_target):
    s = run(tmp_path, feature_store, tiny_target, "rt", num_steps=2)
    assert s.steps == 2 and s.table_version == feature_store[1]
    model, info = load_checkpoint(s.outdir, target_dir=tiny_target)
    saved = load_file(s.outdir / "draft.safetensors")
    state = model.trainable_state_dict()
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in saved)
    assert info["table_version"] == feature_store[1] and info["layer_ids"] == [2, 4, 5]
    assert (model.draft_to_target(torch.arange(512)) == torch.nonzero(model.t2d).flatten()).all()
    prov = json.loads((s.outdir / "provenance.json").read_text())
    assert prov["inputs"] == {"store_uri": feature_store[0], "table": "features", "version": feature_store[1],
                              "target": str(tiny_target), "weights_sha256": weights_hash(str(tiny_target))}


def test_pinned_version_and_errors(tmp_path, feature_store, tiny_target):
    with pytest.raises(StoreError, match="version"):
        run(tmp_path, feature_store, tiny_target, "v", num_steps=1, table_version=999)
    with pytest.raises(StoreError, match="no rows"):
        run(tmp_path, feature_store, tiny_target, "v", num_steps=1, split="nope")
    with pytest.raises(ConfigError, match="train.ttt_steps"):
        TrainConfig(ttt_steps=0)
    with pytest.raises(ConfigError, match="train.step_decay"):
        TrainConfig(step_decay=1.5)


def test_lr_schedule():
    f = [lr_factor(s, total=100, warmup=10, min_ratio=0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_trains_on_the_recipes_feature_table(tmp_path, synth, tiny_target):
    """A second feature set lives in its own table (featurestore.table); train reads that table."""
    from eaglenest.featurestore.config import FeaturestoreConfig

    uri = str(tmp_path / "store")
    samples = synth.greedy_sequences(tiny_target, n=6, prompt_len=8, gen_len=16, seed=5)
    version = synth.write_features(uri, tiny_target, samples, table="second")
    cfg = TrainConfig(**{**FAST, "num_steps": 1})
    s = train(cfg, store_uri=uri, workdir=str(tmp_path / "w"), target_dir=str(tiny_target), seed=0,
              argv=["test"], featurestore=FeaturestoreConfig(table="second"))
    prov = json.loads((s.outdir / "provenance.json").read_text())
    assert prov["inputs"]["table"] == "second" and prov["inputs"]["version"] == version
    with pytest.raises(StoreError, match=rf"^no table 'features' in store {re.escape(uri)}$"):  # the default one
        train(cfg, store_uri=uri, workdir=str(tmp_path / "w2"), target_dir=str(tiny_target), seed=0, argv=["test"])
