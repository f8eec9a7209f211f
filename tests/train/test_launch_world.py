"""``train launch`` refuses a ``train`` section its ranks cannot run before torchrun starts one:
each rank used to refuse it on its own, after loading the target and the features."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.pipeline import train_cli
from eaglenest.train.config import DFlashConfig, TrainConfig


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "2", "train.family=dflash", "train.dflash.num_layers=2"],
     "train.dflash.num_layers=2: a DFlash draft of more than one layer trains in one process"),
    (["--nproc", "3", "train.context_parallel=2"], "train.context_parallel=2: needs a multiple of 2 ranks, "
                                                   "--nnodes x --nproc gives 3"),
])
def test_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch, argv, says):
    started = []
    monkeypatch.setattr(train_cli, "wait_torchrun", lambda cmd: started.append(cmd) or 0)
    assert train_cli.main(["launch", *argv, f"run.workdir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train: error: ") and says in err[-1], err
    assert started == [] and not any(tmp_path.iterdir())


def test_worlds_that_fit_are_accepted():
    train_cli.check_world(TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=2)), 1)
    train_cli.check_world(TrainConfig(family="dflash", dflash=DFlashConfig(num_layers=1)), 4)
    train_cli.check_world(TrainConfig(context_parallel=2), 4)
    with pytest.raises(ConfigError, match="needs a multiple of 2 ranks"):
        train_cli.check_world(TrainConfig(context_parallel=2), 1)
