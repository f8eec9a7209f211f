"""Trackers, seventh pass (hostile user): a training run that fails or is interrupted is not reported to
W&B as one that finished well; a resume is a run of its own, named for the step it resumed from, in
the first run's group."""

from __future__ import annotations

import contextlib

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.train.config import TrackConfig
from eaglenest.train.track import Tracking


def _exit_codes(records) -> list[int]:
    """The ``exit`` records' exit codes among a W&B offline run file's ``records`` (``wandb_log.records``)."""
    return [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]


@pytest.mark.parametrize("failure", [None, StoreError, KeyboardInterrupt])
def test_wandb_run_of_a_failed_training_is_not_marked_finished(tmp_path, monkeypatch, failure, wandb_log):
    """``train run`` closes its trackers from an exit stack: a run stopped by an error (a non-finite loss)
    or Ctrl-C was finished with exit code 0, shown in W&B as a run that completed."""
    import wandb

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in the user's home
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    cfg = TrackConfig(tensorboard=False, tracker="wandb", mode="offline", project="eaglenest-test")
    outdir = tmp_path / "train"
    outdir.mkdir()
    with contextlib.suppress(StoreError, KeyboardInterrupt), contextlib.ExitStack() as own:
        tracking = Tracking.open(cfg, outdir, resume_step=0, active=True, workdir=str(tmp_path), config={})
        own.callback(tracking.close)  # as train/loop.py closes them
        tracking.log({"train/loss": 1.5}, 1)
        if failure is not None:
            raise failure("stopped at step 2")
    wandb.teardown()
    [run_file] = list((outdir / "wandb").glob("offline-run-*/run-*.wandb"))
    codes = _exit_codes(wandb_log.records(run_file))
    assert len(codes) == 1 and (codes[0] == 0) == (failure is None), codes


@pytest.mark.parametrize("resume_step", [0, 7])
def test_wandb_run_of_a_resume_is_its_own_run_in_the_first_ones_group(tmp_path, monkeypatch, resume_step):
    """docs/trackers.md, "Resume": a tracker cannot take points back, so a resume from step N is a new run
    named ``<run_name>-resumed-N`` in the group of the first (``run_name``: the workdir's folder name)."""
    import wandb

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    cfg = TrackConfig(tensorboard=False, tracker="wandb", mode="offline", project="eaglenest-test")
    (tmp_path / "toy" / "train").mkdir(parents=True)
    tracking = Tracking.open(cfg, tmp_path / "toy" / "train", resume_step=resume_step, active=True,
                             workdir=str(tmp_path / "toy"), config={})
    try:
        assert wandb.run is not None and wandb.run.group == "toy"
        assert wandb.run.name == ("toy" if resume_step == 0 else "toy-resumed-7")
    finally:
        tracking.close()
        wandb.teardown()


@pytest.mark.parametrize("name", ["state", "state/", "./select", "metrics.jsonl", "wandb"])
def test_track_dir_naming_the_runs_own_outputs_is_refused(name):
    """``train.track.dir=state`` put the event files among the resume states, where a fresh start's sweep
    of event files and the state pruning both reach them; refused in one line naming another folder."""
    with pytest.raises(ConfigError, match=r"train\.track\.dir: .* is where the run keeps its own .*; name another"):
        TrackConfig(dir=name)
    TrackConfig(dir=name, tensorboard=False)  # no event files: nothing lands there
    TrackConfig(dir=f"{name.strip('./')}-curves")
