"""QA pass 5 on the training core: draft sizes that no engine serves or no rotary can rotate, a
warmup longer than the run, and hostile inputs; each one line naming the key, nothing lost."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline.train_cli import main
from eaglenest.train.config import MAX_HEAD_DIM, DraftShapeConfig, TrainConfig
from eaglenest.train.dist import DistState
from eaglenest.train.loop import check_num_threads
from eaglenest.train.model import draft_shape
from eaglenest.train.spec import DraftShape

sys.path.insert(0, str(Path(__file__).parent))
from test_qa_train import RECIPE, killed_at as _killed_at, run as _run, steps_logged  # noqa: E402  (shared helpers)

TARGET = dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=4, head_dim=32)


@pytest.mark.parametrize("head_dim", [MAX_HEAD_DIM + 2, 1 << 20])
def test_a_head_dim_past_what_vllm_serves_is_one_line_naming_it(tmp_path, capsys, head_dim):
    """train.draft.head_dim=1048576 passed the recipe and was refused by the memory check naming
    train.pack_tokens (896 GiB of activations); 4096 trained a draft no vLLM attention backend serves."""
    with pytest.raises(ConfigError, match=rf"^train.draft.head_dim: at most {MAX_HEAD_DIM} .* got {head_dim}$"):
        DraftShapeConfig(head_dim=head_dim)
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={tmp_path / 'w'}", f"train.draft.head_dim={head_dim}",
               "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "error: train.draft.head_dim: at most" in err[0], err
    DraftShapeConfig(head_dim=MAX_HEAD_DIM)


@pytest.mark.parametrize("head_dim, fraction", [(6, 0.5), (2, 0.25), (20, 0.25)])
def test_a_head_dim_whose_partial_rotary_is_odd_is_refused_naming_it(head_dim, fraction):
    """head_dim 6 on a target rotating half of each head: 3 rotated dims. The draft was built and
    the first forward failed in apply_rotary_pos_emb (a shape traceback, the key unnamed)."""
    target = {**TARGET, "partial_rotary_factor": fraction}
    with pytest.raises(ConfigError) as info:
        draft_shape(target, DraftShape(head_dim=head_dim))
    rot = int(head_dim * fraction)
    assert str(info.value).startswith(f"train.draft.head_dim: {head_dim} x the target's partial rotary factor "
                                      f"{fraction} is {rot} rotated dims")
    assert draft_shape(target, DraftShape(head_dim=head_dim + 2 if fraction == 0.5 else 32))["head_dim"] > 0


def test_a_full_rotary_takes_any_even_head_dim():
    assert draft_shape(TARGET, DraftShape(head_dim=6))["head_dim"] == 6


@pytest.mark.parametrize("warmup, steps, warned", [(20, 4, True), (4, 4, True), (3, 4, False)])
def test_a_warmup_as_long_as_the_run_warns_once_naming_both(tmp_path, feature_store, tiny_target, caplog, warmup,
                                                           steps, warned):
    """train.warmup_steps=20 (the default) with train.num_steps=4 trained at 5-20% of train.lr, the
    cosine never started, and nothing said so."""
    with caplog.at_level(logging.WARNING, logger="eaglenest.train.loop"):
        _run(tmp_path / "w", feature_store, tiny_target, warmup_steps=warmup, num_steps=steps)
    said = [r.getMessage() for r in caplog.records if "train.warmup_steps" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert said[0].startswith(f"train.warmup_steps={warmup} is not below the {steps} step(s) this run trains")


def test_more_threads_than_cpus_is_one_line_before_any_work(tmp_path, feature_store, tiny_target, capsys):
    """train.num_threads=100000 went to torch.set_num_threads as it was: the run died of SIGSEGV in
    torch's OpenMP pool at the first matmul (no line, nothing saved)."""
    work = tmp_path / "w"
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={work}", f"run.target={tiny_target}",
               f"run.store={feature_store[0]}", "train.num_steps=1", "train.num_threads=100000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "error: train.num_threads: 100000 threads per rank is more than the" in err[0], err
    assert not (work / "train" / "checkpoint.json").exists()
    check_num_threads(TrainConfig.num_threads)  # the default runs on any machine


def test_a_rank_past_the_nodes_gpus_is_one_line_naming_the_count(monkeypatch):
    """`train launch --nproc 8` on a node with one GPU: ranks 1-7 died in torch.cuda.set_device with
    CUDA's "invalid device ordinal" traceback each."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's for --nproc 8 (and not a value another test left)
    with pytest.raises(ConfigError) as info:
        DistState.from_env()
    assert str(info.value).startswith("LOCAL_RANK 3: this node has 1 visible GPU(s), so at most --nproc-per-node 1")


def _curve(work: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(work / "train" / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("train/loss")]


def test_a_killed_start_over_leaves_the_resumed_run_its_own_curves(tmp_path, feature_store, tiny_target,
                                                                   monkeypatch):
    """Run A finished; a start-over B (another seed) was killed after its step 1, before its first state;
    A's recipe again resumes A, its state and metrics.jsonl brought back. Its event files had been
    deleted by B's start and TensorBoard showed B's step 1 as the resumed run's whole curve."""
    work = tmp_path / "w"
    _run(work, feature_store, tiny_target)
    first = _curve(work)
    assert [step for step, _ in first] == [1, 2, 3, 4]
    _killed_at(work, feature_store, tiny_target, monkeypatch, 1, seed=7)
    assert [step for step, _ in _curve(work)] == [1] and _curve(work) != first[:1]  # B's own step 1
    _run(work, feature_store, tiny_target)
    assert steps_logged(work) == [1, 2, 3, 4]
    assert _curve(work) == first


@pytest.mark.parametrize("key, value", [("lr", "1e-3"), ("lr", None), ("grad_clip", [1.0]), ("step_decay", True)])
def test_a_rate_that_is_not_a_number_is_one_line_naming_it(key, value):
    """TrainConfig(lr="1e-3") from code (bench scripts, notebooks: no recipe walker coerces it) raised
    math.isfinite's TypeError ("must be real number, not str"), naming neither key nor value."""
    with pytest.raises(ConfigError) as info:
        TrainConfig(**{key: value})
    assert str(info.value).startswith(f"train.{key}: must be a number, got ")
    assert str(value) in str(info.value) or repr(value) in str(info.value)
