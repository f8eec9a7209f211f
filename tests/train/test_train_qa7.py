"""QA of resuming a run whose recipe spells the same value otherwise: ``train.sliding_window`` "auto" and the
number it resolves to, ``train.row_tokens`` 0 and ``pack_tokens``, a ``train.draft.*`` size 0 and the size the
target's rule gives are one draft each (the fingerprint compares resolved values)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train import state as S
from eaglenest.train.config import DraftShapeConfig, TrainConfig
from eaglenest.train.data import FeatureShards
from eaglenest.train.loop import attention_span, resolved_keys
from eaglenest.train.target import load_target_tensors

sys.path.insert(0, str(Path(__file__).parent))
from test_bad_state import TINY, Killed, kill_at, run  # noqa: E402  (the same tiny run and kill helpers)

#: A target config as draft_shape reads it (dense: the draft takes its sizes).
TARGET = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "intermediate_size": 384}


def _fp(cfg: TrainConfig, longest: int = 96, *, resolved: bool = True) -> dict:
    keys = resolved_keys(cfg, TARGET, [longest, 10]) if resolved else None
    return S.fingerprint(cfg, table_version=3, store_uri="s3://b/store", target="org/target", seed=0, resolved=keys)


def _info(fp: dict, tmp_path) -> dict:
    return {"step": 5, "fingerprint": fp, "path": str(tmp_path / "step_5")}


@pytest.mark.parametrize("saved, now", [
    ({"sliding_window": "auto"}, {"sliding_window": 96}),
    ({"row_tokens": 0, "pack_tokens": 128}, {"row_tokens": 128, "pack_tokens": 128}),
    ({}, {"draft": DraftShapeConfig(head_dim=32, num_key_value_heads=2, intermediate_size=384)}),
    ({"family": "dflash", "sliding_window": "auto"}, {"family": "dflash", "sliding_window": 0}),
])
def test_another_spelling_of_the_same_value_resumes_both_ways(tmp_path, saved, now):
    a, b = TrainConfig(**saved), TrainConfig(**now)
    for first, then in ((a, b), (b, a)):
        info = _info(_fp(first), tmp_path)
        assert S.resolve(info, _fp(then), tmp_path) is info


@pytest.mark.parametrize("now, names", [
    ({"sliding_window": 32}, "train.sliding_window 96 -> 32"),
    ({"sliding_window": 0}, "train.sliding_window 96 -> 0"),
    ({"sliding_window": "auto", "row_tokens": 100}, "train.row_tokens 512 -> 100"),
    ({"sliding_window": "auto", "draft": DraftShapeConfig(head_dim=16)}, "train.draft.head_dim 32 -> 16"),
])
def test_another_value_is_still_refused_naming_it(tmp_path, now, names):
    info = _info(_fp(TrainConfig(sliding_window="auto")), tmp_path)
    with pytest.raises(ConfigError) as err:
        S.resolve(info, _fp(TrainConfig(**now)), tmp_path)
    assert names in str(err.value) and "train.state.resume=never" in str(err.value)


def test_auto_resolves_to_another_window_when_the_samples_change(tmp_path):
    info = _info(_fp(TrainConfig(sliding_window="auto"), 96), tmp_path)
    with pytest.raises(ConfigError, match="train.sliding_window 96 -> 64"):
        S.resolve(info, _fp(TrainConfig(sliding_window="auto"), 64), tmp_path)


def test_a_state_saved_without_resolved_values_compares_the_spelling(tmp_path):
    """States saved before: no resolved values in their fingerprint; the same spelling still resumes."""
    info = _info(_fp(TrainConfig(sliding_window="auto"), resolved=False), tmp_path)
    assert S.resolve(info, _fp(TrainConfig(sliding_window="auto")), tmp_path) is info
    with pytest.raises(ConfigError, match="train.sliding_window 'auto' -> 32"):
        S.resolve(info, _fp(TrainConfig(sliding_window=32)), tmp_path)


def test_a_killed_run_resumes_with_its_defaults_written_as_the_values_they_resolve_to(tmp_path, feature_store,
                                                                                     tiny_target, monkeypatch):
    work = tmp_path / "w"
    kill_at(monkeypatch, 1)
    with pytest.raises(Killed):
        run(work, feature_store, tiny_target, sliding_window="auto")
    monkeypatch.undo()
    shards = FeatureShards(feature_store[0], version=None, split="train", pack_tokens=TINY["pack_tokens"],
                           batch_rows=2, seed=0)
    try:
        window = attention_span(TrainConfig(sliding_window="auto", pack_tokens=TINY["pack_tokens"]), shards.lengths)
    finally:
        shards.close()
    tc = load_target_tensors(tiny_target, only=("norm",))["config"]
    assert window > 0
    spelled = DraftShapeConfig(head_dim=int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"]),
                               intermediate_size=int(tc["intermediate_size"]))
    # Was refused: train.draft.head_dim 0 -> 32; train.row_tokens 0 -> 64; train.sliding_window 'auto' -> N.
    s = run(work, feature_store, tiny_target, sliding_window=window, row_tokens=TINY["pack_tokens"], draft=spelled)
    assert s.steps == 2
    lines = (work / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]  # step 1 was not trained again


def test_num_steps_zero_and_the_steps_it_trains_resume_each_other(tmp_path):
    def fp(cfg, total):
        return {**_fp(cfg), S.RESOLVED: {**_fp(cfg)[S.RESOLVED], "num_steps": total}}

    info = _info(fp(TrainConfig(num_steps=0), 48), tmp_path)
    assert S.resolve(info, {**fp(TrainConfig(num_steps=48), 48), S.PLAN_STEPS: 48}, tmp_path) is info
    with pytest.raises(ConfigError, match="train.num_steps 48 -> 40"):
        S.resolve(info, {**fp(TrainConfig(num_steps=40), 40), S.PLAN_STEPS: 40}, tmp_path)


def test_a_killed_run_of_every_epoch_resumes_with_num_steps_written_as_its_steps(tmp_path, feature_store,
                                                                                tiny_target, monkeypatch):
    work = tmp_path / "w"
    kill_at(monkeypatch, 1)
    with pytest.raises(Killed):
        run(work, feature_store, tiny_target, num_steps=0, num_epochs=1)
    monkeypatch.undo()
    shards = FeatureShards(feature_store[0], version=None, split="train", pack_tokens=TINY["pack_tokens"],
                           batch_rows=TINY["batch_rows"], seed=0)
    try:
        steps = len(shards.plan(0))
    finally:
        shards.close()
    assert steps > 2
    s = run(work, feature_store, tiny_target, num_steps=steps, num_epochs=1)  # was refused: num_steps 0 -> N
    assert s.steps == steps
    lines = (work / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, steps + 1))  # step 1 was not trained again
