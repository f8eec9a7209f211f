"""FSDP2 and resume: a 2-rank gloo run matches the 1-rank run; SIGKILL + resume continues exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglenest.config import apply_overrides, build
from eaglenest.errors import ConfigError
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import train

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
# 24 samples of 32 tokens, 3 per row -> 8 rows -> global batches of 3, 3, 2 rows: uneven shards.
TRAJ = dict(draft_vocab_size=512, ttt_steps=3, pack_tokens=96, batch_rows=3, warmup_steps=5, lr=2e-3,
            num_epochs=7, num_steps=20, log_every_steps=1, num_threads=1,
            sliding_window="auto")  # as recipes/toy.yaml, which the torchrun launches read


def config(cfg: dict) -> TrainConfig:
    """``cfg`` (recipe keys under ``train``, dotted for a section: ``state.every_steps``) read as the
    recipe loader reads the torchrun launches' overrides."""
    return build(TrainConfig, apply_overrides({}, [f"{k}={v}" for k, v in cfg.items()]), where="train")


def overrides(cfg: dict, workdir: Path, store, target) -> list[str]:
    return [f"run.workdir={workdir}", f"run.target={target}", f"run.store={store[0]}",
            *(f"train.{k}={v}" for k, v in cfg.items())]


def metrics(workdir: Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "train" / "metrics.jsonl").read_text().splitlines()]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


#: Every draft family trains on several ranks as on one (DFlash: a one-layer draft; more is refused).
FAMILIES = {"eagle3": {}, "peagle": {"family": "peagle"},
            "dflash": {"family": "dflash", "dflash.num_layers": 1, "dflash.block_size": 4}}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_match_one_rank(tmp_path, feature_store, tiny_target, family):
    cfg = {**TRAJ, **FAMILIES[family]}
    one = train(config(cfg), store_uri=feature_store[0], workdir=str(tmp_path / "one"),
                target_dir=str(tiny_target), seed=0)
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "2", "--recipe", RECIPE,
           *overrides(cfg, tmp_path / "two", feature_store, tiny_target)]
    tmp = tmp_path / "tmp"  # the launch's temp dir: torchrun's folder of error files is removed once it reported
    tmp.mkdir()
    proc = subprocess.run(cmd, env={**env(), "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-12000:]
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(("torchelastic_", "eaglenest-torchrun-"))]
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert one.steps == 20 and [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 21))
    assert a[-1]["loss"] < 0.8 * a[0]["loss"]  # it trains
    for x, y in zip(a, b):
        # fp32 sums split over ranks differ in rounding only: relative 1e-4 over 20 steps.
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6), (x["step"], x["loss"], y["loss"])
        assert y["step_count"] == x["step_count"] and y["tokens"] == x["tokens"]
        assert y["step_acc"] == pytest.approx(x["step_acc"], abs=0.02)
    prov = json.loads((tmp_path / "two" / "train" / "provenance.json").read_text())
    assert prov["world_size"] == 2
    state = json.loads((tmp_path / "two" / "train" / "state" / "latest.json").read_text())
    assert state["step"] == 20


KILL = dict(draft_vocab_size=512, ttt_steps=7, pack_tokens=128, batch_rows=2, warmup_steps=5, lr=5e-3,
            num_epochs=7, num_steps=20, log_every_steps=1, num_threads=1, sliding_window="auto",
            **{"state.every_steps": 3})


@pytest.mark.slow
def test_sigkill_then_resume_continues_exactly(tmp_path, feature_store, tiny_target):
    work = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "run", "--recipe", RECIPE,
           *overrides(KILL, work, feature_store, tiny_target)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = work / "train" / "state" / "latest.json"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and json.loads(latest.read_text())["step"] >= 3:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before it could be killed: " + proc.stderr.read()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert 3 <= killed_at < 20
    # Resuming the killed run against another table version or recipe is refused, naming the difference.
    with pytest.raises(ConfigError, match="features_version"):
        train(config({**KILL, "table_version": feature_store[1] - 1}), store_uri=feature_store[0],
              workdir=str(work), target_dir=str(tiny_target), seed=0)
    with pytest.raises(ConfigError, match="train.lr"):
        train(config({**KILL, "lr": 1e-3}), store_uri=feature_store[0], workdir=str(work),
              target_dir=str(tiny_target), seed=0)
    cfg = config(KILL)
    resumed = train(cfg, store_uri=feature_store[0], workdir=str(work), target_dir=str(tiny_target), seed=0)
    whole = train(cfg, store_uri=feature_store[0], workdir=str(tmp_path / "whole"),
                  target_dir=str(tiny_target), seed=0)
    assert resumed.steps == whole.steps == 20
    a, b = metrics(work), metrics(tmp_path / "whole")
    assert [m["step"] for m in a] == list(range(1, 21))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bit for bit
    assert [m["step_acc"] for m in a] == [m["step_acc"] for m in b]
    from safetensors.torch import load_file

    wa, wb = load_file(work / "train" / "draft.safetensors"), load_file(tmp_path / "whole" / "train" / "draft.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)

    # Re-running the finished run has nothing left to do.
    again = train(cfg, store_uri=feature_store[0], workdir=str(work), target_dir=str(tiny_target), seed=0)
    assert again.steps == 20 and metrics(work) == a

    # A finished run of another recipe is not resumed: auto starts over.
    other = train(config({**KILL, "lr": 1e-3, "num_steps": 2}), store_uri=feature_store[0],
                  workdir=str(work), target_dir=str(tiny_target), seed=0)
    assert other.steps == 2 and len(metrics(work)) == 2


def test_launch_validates_the_recipe_before_starting_ranks(capsys):
    from eaglenest.pipeline.train_cli import main

    assert main(["launch", "--nproc", "2", "--recipe", RECIPE, "train.state.resume=maybe"]) == 2
    assert "train.state.resume" in capsys.readouterr().err
    assert main(["launch", "--nproc", "2", "--recipe", RECIPE, "train.resume=never"]) == 2  # the flat key
    assert "train.resume: renamed to train.state.resume" in capsys.readouterr().err
