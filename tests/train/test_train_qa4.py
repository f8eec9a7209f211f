"""QA pass 4 on the training core: a best/ swap killed midway, a checkpoint of another target's
weights, resumes refused for keys that do not change the trajectory, and hostile inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train import state as S
from eaglenest.train.checkpoint import INFO
from eaglenest.train.config import SelectConfig, TrainConfig
from eaglenest.train.selection import BEST, BEST_ASIDE, Selector

sys.path.insert(0, str(Path(__file__).parent))
from test_qa_train import killed_at as _killed_at, run as _run  # noqa: E402  (the same run and kill helpers)


class Killed(Exception):
    """Stands for a SIGKILL at one point of a save."""



def _selector(outdir: Path, als: dict[int, float], *, resume_step: int, target) -> Selector:
    def score(snapshot):
        return {"served_al": als[json.loads((snapshot / INFO).read_text())["step"]], "prompts": 2}

    return Selector(outdir, cfg=SelectConfig(every_steps=2), score=score, target_dir=str(target), active=True,
                    resume_step=resume_step)


def test_a_kill_while_best_is_replaced_keeps_the_previous_best(tmp_path, peagle_draft, at_step, tiny_target,
                                                               monkeypatch):
    """Selector.evaluate deleted best/ and then renamed the new snapshot in: a kill between the two
    left no best/ at all, and the resumed run's checkpoint was its last step's, not step 2's (AL 2.5)."""
    first = _selector(tmp_path, {2: 2.5, 4: 3.0}, resume_step=0, target=tiny_target)
    first.evaluate(2, at_step(peagle_draft, 2), info={"step": 2})
    real = Path.replace

    def killed_renaming_in(self, target):
        if self.name == ".best.tmp":
            raise Killed()
        return real(self, target)

    monkeypatch.setattr(Path, "replace", killed_renaming_in)
    with pytest.raises(Killed):
        first.evaluate(4, at_step(peagle_draft, 4), info={"step": 4})
    monkeypatch.undo()
    resumed = _selector(tmp_path, {}, resume_step=2, target=tiny_target)
    assert (tmp_path / BEST / INFO).is_file() and not (tmp_path / BEST_ASIDE).exists()
    model, info = resumed.finish(at_step(peagle_draft, 3), {"step": 3})
    assert (info["selection"]["best_step"], info["selection"]["best_served_al"]) == (2, 2.5)
    assert float(model.fc.weight[0, 0].detach()) == 2.0


def test_a_kill_after_the_new_best_is_in_drops_the_aside_copy(tmp_path, peagle_draft, at_step, tiny_target,
                                                              monkeypatch):
    """The new best/ renamed in, the old one not yet deleted: the next run keeps the new one."""
    import shutil

    first = _selector(tmp_path, {2: 2.5, 4: 3.0}, resume_step=0, target=tiny_target)
    first.evaluate(2, at_step(peagle_draft, 2), info={"step": 2})
    real = shutil.rmtree

    def killed_deleting_aside(path, *a, **kw):
        if Path(path).name == BEST_ASIDE and Path(path).exists():
            raise Killed()
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", killed_deleting_aside)
    with pytest.raises(Killed):
        first.evaluate(4, at_step(peagle_draft, 4), info={"step": 4})
    monkeypatch.undo()
    assert (tmp_path / BEST_ASIDE / INFO).is_file()  # the window this test is about
    resumed = _selector(tmp_path, {}, resume_step=4, target=tiny_target)
    assert not (tmp_path / BEST_ASIDE).exists()
    model, info = resumed.finish(at_step(peagle_draft, 4), {"step": 4})
    assert (info["selection"]["best_step"], info["selection"]["best_served_al"]) == (4, 3.0)
    assert float(model.fc.weight[0, 0].detach()) == 4.0


def _resumed_at_2(work: Path, caplog, store, target, **kw):
    import logging

    with caplog.at_level(logging.INFO, logger="eaglenest.train.state"):
        summary = _run(work, store, target, **kw)
    assert "step_00000002 at step 2" in caplog.text  # resumed there, not refused nor started over
    steps = [json.loads(x)["step"] for x in (work / "train" / "metrics.jsonl").read_text().splitlines()]
    assert summary.steps == 4 and steps == [1, 2, 3, 4]
    return summary


def test_another_num_epochs_resumes_when_num_steps_ends_the_run_first(tmp_path, feature_store, tiny_target,
                                                                      monkeypatch, caplog):
    """Was refused: "cannot resume ... (train.num_epochs 4 -> 3)", though both plans train the same 4 steps."""
    work = tmp_path / "w"
    _killed_at(work, feature_store, tiny_target, monkeypatch, 3, num_epochs=4)
    _resumed_at_2(work, caplog, feature_store, tiny_target, num_epochs=3)


def test_another_num_epochs_that_changes_the_steps_trained_is_still_refused(tmp_path):
    now = S.fingerprint(TrainConfig(num_steps=50, num_epochs=2), table_version=1, store_uri="s3://b/x",
                        target="org/t", seed=0)
    saved = S.fingerprint(TrainConfig(num_steps=50, num_epochs=1), table_version=1, store_uri="s3://b/x",
                          target="org/t", seed=0)
    info = {"fingerprint": {**saved, S.PLAN_STEPS: 24}, "step": 3, "path": str(tmp_path / "s")}
    with pytest.raises(ConfigError) as err:
        S.resolve(info, {**now, S.PLAN_STEPS: 48}, tmp_path)
    assert "train.num_epochs 1 -> 2" in str(err.value) and "plan_steps 24 -> 48" in str(err.value)
    assert S.resolve({**info, "fingerprint": {**saved, S.PLAN_STEPS: 48}}, {**now, S.PLAN_STEPS: 48},
                     tmp_path) is not None
    # a state saved before plan_steps existed compares num_epochs as it did
    with pytest.raises(ConfigError, match="train.num_epochs 1 -> 2"):
        S.resolve({**info, "fingerprint": saved}, {**now, S.PLAN_STEPS: 48}, tmp_path)


@pytest.mark.parametrize("family", ["peagle", "dflash"])
@pytest.mark.parametrize("first, then", [(None, 0), (0, None)])
def test_a_mask_token_id_spelled_as_the_targets_pad_resumes(tmp_path, feature_store, tiny_target, monkeypatch, caplog,
                                                            family, first, then):
    """The tiny target's pad_token_id is 0: null and 0 train the same draft; was refused
    ("train.peagle.mask_token_id None -> 0")."""
    from eaglenest.train.config import DFlashConfig, PEagleConfig

    def section(mask):
        return ({"peagle": PEagleConfig(mask_token_id=mask)} if family == "peagle"
                else {"dflash": DFlashConfig(num_layers=1, mask_token_id=mask)})

    work = tmp_path / "w"
    _killed_at(work, feature_store, tiny_target, monkeypatch, 3, family=family, **section(first))
    _resumed_at_2(work, caplog, feature_store, tiny_target, family=family, **section(then))


def test_a_mask_token_id_other_than_the_pad_is_still_refused(tmp_path, feature_store, tiny_target, monkeypatch):
    from eaglenest.train.config import PEagleConfig

    work = tmp_path / "w"
    _killed_at(work, feature_store, tiny_target, monkeypatch, 3, family="peagle")
    with pytest.raises(ConfigError) as err:
        _run(work, feature_store, tiny_target, family="peagle", peagle=PEagleConfig(mask_token_id=2))
    assert "train.peagle.mask_token_id None -> 2" in str(err.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, feature_store, tiny_target):
    return _run(tmp_path_factory.mktemp("trained") / "w", feature_store, tiny_target, num_steps=1).outdir


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, tiny_target):
    """A copy of the tiny target, the same shapes, one weight changed."""
    import shutil

    from safetensors.torch import load_file, save_file

    other = tmp_path_factory.mktemp("other") / "other-target"
    shutil.copytree(tiny_target, other)
    for path in other.glob("*.safetensors"):
        tensors = load_file(str(path))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name] + 1
        save_file(tensors, str(path), metadata={"format": "pt"})
    return other


def test_a_checkpoint_records_its_targets_weights(trained, tiny_target):
    from eaglenest.featurestore.capture.identity import weights_hash

    info = json.loads((trained / INFO).read_text())
    assert info["target_weights_sha256"] == weights_hash(str(tiny_target))


def test_export_with_another_target_of_the_same_shape_is_refused(tmp_path, trained, tiny_target, other_weights):
    """Was exported silently: the draft then proposes for a target whose hidden states it never saw."""
    from eaglenest.serve.export import export_draft

    with pytest.raises(ConfigError) as err:
        export_draft(trained, tmp_path / "draft", target_dir=other_weights)
    message = str(err.value)
    assert "\n" not in message and str(other_weights) in message and "run.off_policy=true" in message
    assert str(tiny_target) in message and not (tmp_path / "draft").exists()
    assert (export_draft(trained, tmp_path / "same", target_dir=tiny_target) / "model.safetensors").is_file()


def test_export_with_another_target_goes_on_off_policy_or_for_an_old_checkpoint(tmp_path, trained, other_weights,
                                                                                caplog):
    import logging
    import shutil

    from eaglenest.serve.export import export_draft

    with caplog.at_level(logging.WARNING, logger="eaglenest.serve.export"):
        out = export_draft(trained, tmp_path / "off", target_dir=other_weights, off_policy=True)
    assert (out / "model.safetensors").is_file() and "run.off_policy=true" in caplog.text
    old = tmp_path / "old"  # a checkpoint saved before the record existed
    shutil.copytree(trained, old, ignore=shutil.ignore_patterns("state", "best", ".*"))
    info = json.loads((old / INFO).read_text())
    del info["target_weights_sha256"]
    (old / INFO).write_text(json.dumps(info))
    assert (export_draft(old, tmp_path / "old-draft", target_dir=other_weights) / "model.safetensors").is_file()


def test_serve_export_takes_run_off_policy_for_another_target(tmp_path, trained, other_weights, capsys):
    """The command line's ``run.off_policy=true`` reaches the export's target check."""
    import shutil

    from eaglenest.serve.cli import main as serve_main

    work = tmp_path / "work"
    shutil.copytree(trained, work / "train", ignore=shutil.ignore_patterns("state", "best", ".*"))
    argv = ["export", f"--recipe={Path(__file__).resolve().parents[2] / 'recipes' / 'toy.yaml'}",
            f"run.workdir={work}", f"run.target={other_weights}"]
    assert serve_main(argv) == 2
    assert "run.off_policy=true" in capsys.readouterr().err and not (work / "draft").exists()
    assert serve_main([*argv, "run.off_policy=true"]) == 0
    assert (work / "draft" / "model.safetensors").is_file()


def test_a_table_without_a_loss_token_says_so_and_unpins_its_version(tmp_path, synth, tiny_target):
    """Was "no rows to train on (check train.split='train' ...)" for rows of that very split whose
    loss_mask is all 0, and the version stayed pinned against gc after the refusal."""
    from eaglenest.errors import StoreError
    from eaglenest.featurestore.table import lease

    uri = str(tmp_path / "store")
    samples = synth.greedy_sequences(tiny_target, n=3, prompt_len=8, gen_len=24)
    version = synth.write_features(uri, tiny_target, [(ids, [0] * len(mask)) for ids, mask in samples])
    with pytest.raises(StoreError) as err:
        _run(tmp_path / "w", (uri, version), tiny_target)
    assert f"features v{version}: no rows to train on: its 3 rows of train.split='train' have no loss token" \
        in str(err.value)
    assert lease.pinned_versions(uri, "features") == set()
    with pytest.raises(StoreError, match=r"no rows to train on \(check train.split='test'"):
        _run(tmp_path / "w", (uri, version), tiny_target, split="test")


@pytest.mark.parametrize("key, value", [("vocab_size", None), ("vocab_size", "abc"), ("vocab_size", 1000.5),
                                        ("hidden_size", None), ("hidden_size", "128"), ("rms_norm_eps", "x"),
                                        ("rms_norm_eps", None)])
def test_a_bad_size_in_the_targets_config_is_one_line_naming_it(tmp_path, tiny_target, key, value):
    """Were a KeyError, ValueError or TypeError traceback (or, for "128", a hidden-size mismatch with
    the features that named the wrong cause)."""
    import shutil

    from eaglenest.train.target import load_target_tensors

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg[key] = value
    if value is None and key != "rms_norm_eps":
        del cfg[key]
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        load_target_tensors(target)
    assert str(err.value).startswith(f"run.target: {target / 'config.json'}: {key}: ")
    assert repr(value) in str(err.value) and "\n" not in str(err.value)


def test_a_start_over_sets_aside_a_best_left_mid_swap(tmp_path, feature_store, tiny_target, monkeypatch):
    """A kill mid best/ swap leaves the previous best only as .best.old: a start-over
    (train.state.resume=never) set the run's state and books aside without it, and it was lost."""
    from eaglenest.train.config import StateConfig

    work = tmp_path / "w"
    _killed_at(work, feature_store, tiny_target, monkeypatch, 3)
    aside = work / "train" / BEST_ASIDE
    aside.mkdir()
    (aside / INFO).write_text(json.dumps({"step": 2}))
    _killed_at(work, feature_store, tiny_target, monkeypatch, 1, state=StateConfig(every_steps=2, resume="never"))
    kept = work / "train" / "state.previous" / "books" / BEST
    assert json.loads((kept / INFO).read_text()) == {"step": 2} and not aside.exists()
