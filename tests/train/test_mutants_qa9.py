"""Tests written against mutants of the training core that no test killed (second audit): each checks the
behaviour from first principles (an independent reference, an invariant, a round trip), not the code's own numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.pipeline import train_cli
from eaglenest.train import peagle as P, state as S
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig
from eaglenest.train.model import causal_doc_mask


@pytest.mark.parametrize("window", [1, 2, 3])
def test_windowed_masks_see_exactly_the_last_window_positions(window):
    """vLLM's sliding window: a query at position q sees keys at positions s with q - s < window, itself included
    (depth-0 rows of :func:`causal_doc_mask` and the P-EAGLE slots, which sit at pos(a) + d)."""
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    m = causal_doc_mask(doc, window=window)[0]
    for q in range(8):
        for s in range(8):
            assert bool(m[q, s]) == (s <= q and doc[0, s] == doc[0, q] and q - s < window), (q, s)
    num_slots = 3
    batch = P.PEagleBatch(input_ids=torch.zeros(1, 8, dtype=torch.long), loss_mask=torch.ones(1, 8, dtype=torch.bool),
                          doc_ids=doc, position_ids=pos, aux=None, last_hidden=None,
                          anchors=torch.tensor([[3, 6]]), anchor_ok=torch.ones(1, 2, dtype=torch.bool))
    sm = P.slot_mask(batch, num_slots, window=window)[0]
    for j in range(2 * (num_slots - 1)):
        a, d = int(batch.anchors[0, j // (num_slots - 1)]), 1 + j % (num_slots - 1)
        for s in range(8):
            want = s <= a and doc[0, s] == doc[0, a] and int(pos[0, a]) + d - int(pos[0, s]) < window
            assert bool(sm[8 + j, s]) == want, (a, d, s)


#: Train keys that change what a run trains (its samples, their order, the draft, the loss or the optimizer):
#: a state of one value is never resumed under another.
TRAJECTORY = {"batch_rows": 3, "pack_tokens": 256, "row_tokens": 128, "lr": 1e-3, "min_lr_ratio": 0.5,
              "warmup_steps": 3, "weight_decay": 0.01, "grad_clip": 0.5, "step_decay": 0.5, "ttt_steps": 3,
              "draft_vocab_size": 512, "split": "other", "init_lm_head": "random", "init_norm": "ones",
              "oov_positions": "drop", "norm_output": True, "num_epochs": 2, "family": "peagle",
              "context_parallel": 2}


def _fp(cfg):
    return S.fingerprint(cfg, table_version=1, store_uri="s3://b/x", target="org/t", seed=0)


@pytest.mark.parametrize("key", sorted(TRAJECTORY))
def test_a_key_that_changes_the_trajectory_is_refused_on_resume(tmp_path, key):
    info = {"step": 3, "fingerprint": _fp(TrainConfig()), "path": str(tmp_path / "s")}
    with pytest.raises(ConfigError, match=f"train.{key} "):
        S.resolve(info, _fp(TrainConfig(**{key: TRAJECTORY[key]})), tmp_path)


@pytest.mark.parametrize("family, section", [("peagle", PEagleConfig(num_slots=3)),
                                             ("dflash", DFlashConfig(block_size=4))])
def test_the_family_section_of_the_family_trained_is_compared_on_resume(tmp_path, family, section):
    info = {"step": 3, "fingerprint": _fp(TrainConfig(family=family)), "path": str(tmp_path / "s")}
    with pytest.raises(ConfigError, match=f"train.{family}."):
        S.resolve(info, _fp(TrainConfig(family=family, **{family: section})), tmp_path)


@pytest.mark.slow
def test_a_rank_without_rows_of_its_own_trains_nothing(tmp_path, synth, tiny_target):
    """One sample, two ranks: every global batch has one row, so rank 1 gets it as a ghost (it runs the step for
    the collectives). The ghost must add no loss, count or token: the 2-rank run equals the 1-rank run."""
    uri = str(tmp_path / "store")
    synth.write_features(uri, tiny_target, [([5, 9, 11, 13, 17, 19, 23, 29], [0, 0, 1, 1, 1, 1, 1, 1])])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"run: {{target: {tiny_target}, store: {uri}}}\n"
                      "train: {draft_vocab_size: 64, ttt_steps: 2, pack_tokens: 16, batch_rows: 2, num_steps: 2, "
                      "warmup_steps: 1, log_every_steps: 1, num_threads: 1}\n")
    assert train_cli.main(["run", "--recipe", str(recipe), f"run.workdir={tmp_path / 'one'}"]) == 0
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "2", "--recipe", str(recipe),
           f"run.workdir={tmp_path / 'two'}"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    def metrics(name):
        return [json.loads(x) for x in (tmp_path / name / "train" / "metrics.jsonl").read_text().splitlines()]

    one, two = metrics("one"), metrics("two")
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2]
    for x, y in zip(one, two):
        assert y["step_count"] == x["step_count"] == [6, 5] and y["tokens"] == x["tokens"] == 8
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
