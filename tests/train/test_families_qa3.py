"""QA of the parallel drafters' training books: resuming a run whose recipe spells the same
trajectory differently, and the best snapshot of served-AL selection across a resumed run."""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train import state as S
from eaglenest.train.config import TrainConfig


def _fp(cfg: TrainConfig, seed: int) -> dict:
    return S.fingerprint(cfg, table_version=3, store_uri="s3://b/store", target="org/target", seed=seed)


@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_a_seed_given_as_the_run_seed_resumes(tmp_path, family):
    """``train.seed=0`` on a run killed under ``run.seed: 0`` (train.seed null) was refused ("train.seed
    None -> 0"), though the run trains with seed 0 either way; the other way round too."""
    saved = {"step": 5, "fingerprint": _fp(TrainConfig(family=family), 0), "path": str(tmp_path / "step_5")}
    assert S.resolve(saved, _fp(TrainConfig(family=family, seed=0), 0), tmp_path) is saved
    back = {**saved, "fingerprint": _fp(TrainConfig(family=family, seed=0), 0)}
    assert S.resolve(back, _fp(TrainConfig(family=family), 0), tmp_path) is back


def test_a_state_saved_with_train_seed_in_its_fingerprint_still_resumes(tmp_path):
    """States saved before: their fingerprint holds ``train.seed`` as written (null or a number)."""
    for written in (None, 0):
        old = _fp(TrainConfig(), 0)
        old["train"]["seed"] = written
        saved = {"step": 5, "fingerprint": old, "path": str(tmp_path / "step_5")}
        assert S.resolve(saved, _fp(TrainConfig(seed=0), 0), tmp_path) is saved
        assert S.resolve(saved, _fp(TrainConfig(), 0), tmp_path) is saved


def test_another_seed_is_still_refused_naming_it(tmp_path):
    saved = {"step": 5, "fingerprint": _fp(TrainConfig(), 0), "path": str(tmp_path / "step_5")}
    with pytest.raises(ConfigError) as err:
        S.resolve(saved, _fp(TrainConfig(seed=1), 1), tmp_path)
    assert "seed 0 -> 1" in str(err.value) and "train.state.resume=never" in str(err.value)



def _selector(outdir, als: dict[int, float], *, resume_step: int, target):
    from eaglenest.train.config import SelectConfig
    from eaglenest.train.selection import Selector

    def score(snapshot):
        return {"served_al": als[json.loads((snapshot / "checkpoint.json").read_text())["step"]], "prompts": 2}

    return Selector(outdir, cfg=SelectConfig(every_steps=2), score=score, target_dir=str(target), active=True,
                    resume_step=resume_step)


def test_best_carries_its_own_step_and_served_al_across_a_resume(tmp_path, peagle_draft, at_step, tiny_target):
    """A run evaluated step 2 (AL 2.0) and step 4 (AL 3.0: best/), was killed with its state at step 3,
    and resumed; step 4, served again, scored 1.5. best/ kept the first segment's step-4 weights while
    checkpoint.json said best_step 2, best_served_al 2.0 (selection.jsonl's best): weights of one
    step labelled with another's AL. Now best/ is the resumed run's own, labelled with its own record."""
    import torch

    from eaglenest.train.checkpoint import INFO

    first = _selector(tmp_path, {2: 2.0, 4: 3.0}, resume_step=0, target=tiny_target)
    for step in (2, 4):
        first.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    assert json.loads((tmp_path / "best" / INFO).read_text())["step"] == 4
    resumed = _selector(tmp_path, {4: 1.5, 6: 1.8}, resume_step=3, target=tiny_target)
    for step in (4, 6):
        resumed.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    model, info = resumed.finish(at_step(peagle_draft, 6), {"step": 6})
    sel = info["selection"]
    assert (sel["best_step"], sel["best_served_al"], sel["last_step"]) == (info["step"], 1.8, 6) == (6, 1.8, 6)
    assert float(model.fc.weight[0, 0].detach()) == 6.0
    report = json.loads((tmp_path / "best" / "selection.json").read_text())
    assert (report["step"], report["served_al"]) == (6, 1.8)
    assert not torch.equal(model.fc.weight[1:], torch.zeros_like(model.fc.weight[1:]))


def test_best_from_before_the_resumed_step_is_kept_and_compared_by_its_own_record(tmp_path, peagle_draft, at_step,
                                                                                  tiny_target):
    """A best/ at or before the resumed step is the resumed run's own: kept, and a later evaluation
    replaces it only by a higher served AL than its own."""
    first = _selector(tmp_path, {2: 2.5, 4: 2.0}, resume_step=0, target=tiny_target)
    for step in (2, 4):
        first.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    resumed = _selector(tmp_path, {4: 2.0, 6: 2.4}, resume_step=3, target=tiny_target)
    for step in (4, 6):
        resumed.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    model, info = resumed.finish(at_step(peagle_draft, 6), {"step": 6})
    assert (info["selection"]["best_step"], info["selection"]["best_served_al"], info["step"]) == (2, 2.5, 2)
    assert float(model.fc.weight[0, 0].detach()) == 2.0


def test_a_best_saved_before_its_own_record_is_labelled_from_selection_jsonl(tmp_path, peagle_draft, at_step,
                                                                             tiny_target):
    """A run folder from before best/selection.json: best/'s step (its checkpoint.json) finds its served
    AL in selection.jsonl, so a re-run of the finished run still keeps and labels it."""
    first = _selector(tmp_path, {2: 2.5, 4: 2.0}, resume_step=0, target=tiny_target)
    for step in (2, 4):
        first.evaluate(step, at_step(peagle_draft, step), info={"step": step})
    (tmp_path / "best" / "selection.json").unlink()
    again = _selector(tmp_path, {}, resume_step=4, target=tiny_target)
    model, info = again.finish(at_step(peagle_draft, 4), {"step": 4})
    assert (info["selection"]["best_step"], info["selection"]["best_served_al"], info["step"]) == (2, 2.5, 2)
    assert float(model.fc.weight[0, 0].detach()) == 2.0


def _tiny_training_state():
    import torch

    from eaglenest.train.dist import DistState

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    return model, opt, sched, DistState()


def test_a_signal_while_the_state_is_saved_ends_as_that_signal(tmp_path, monkeypatch):
    """SIGTERM (or Ctrl-C) landing while torch's DCP wrote the state ended ``train run`` with a
    CheckpointException traceback and exit 1: DCP wraps every exception of its writers, the
    interruption included. The interruption itself now comes out (the CLI ends by that signal),
    and the previous state is left as it was."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from eaglenest.launch import Terminated

    model, opt, sched, dist = _tiny_training_state()
    kw = dict(objective=model, opt=opt, sched=sched, dist=dist, fp={}, extra={}, keep=2)
    S.save_state(tmp_path, step=3, **kw)

    def killed(*args, **kwargs):
        raise Terminated(15)

    monkeypatch.setattr(FileSystemWriter, "write_data", killed)
    with pytest.raises(Terminated) as err:
        S.save_state(tmp_path, step=6, **kw)
    assert err.value.signum == 15
    assert S.read_latest(tmp_path)["step"] == 3


def test_ctrl_c_while_a_state_loads_is_no_damaged_state(tmp_path, monkeypatch):
    """Ctrl-C while a resume read the state was reported as "damaged training state (...): set
    train.state.resume=never to start over, or delete <state>": advice that throws a whole run away
    over a keypress. The interruption itself now comes out."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    model, opt, sched, dist = _tiny_training_state()
    S.save_state(tmp_path, step=3, objective=model, opt=opt, sched=sched, dist=dist, fp={}, extra={}, keep=2)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt) as err:
        S.load_state(S.read_latest(tmp_path), objective=model, opt=opt, sched=sched, dist=dist)
    assert type(err.value) is KeyboardInterrupt
