"""``serve export`` of a checkpoint folder whose training was interrupted (QA8).

``train run`` writes checkpoint.json only when a run finishes. Before the fix, a start-over with another
recipe killed half-way left the earlier run's checkpoint.json beside the new run's unfinished state, and
export published that earlier draft without a word; a first run killed before it finished gave
"no checkpoint.json (... run `train run` first)" although the run was there to resume. Real training
runs on the tiny target's features (no engine); the kill is the trainer tests' own (an exception raised
before a step, as SIGKILL would stop it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.export import is_export
from eaglenest.train.config import StateConfig, TrainConfig
from eaglenest.train.loop import _Trainer, train

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(draft_vocab_size=256, ttt_steps=2, pack_tokens=64, batch_rows=2, warmup_steps=1, log_every_steps=1,
            num_steps=4, num_threads=1, state=StateConfig(every_steps=2))


class Killed(Exception):
    """Stands for a SIGKILL in the middle of the loop."""


@pytest.fixture(scope="module")
def features(tmp_path_factory, synth, tiny_target):
    uri = str(tmp_path_factory.mktemp("store") / "store")
    synth.write_features(uri, tiny_target, synth.greedy_sequences(tiny_target, n=12, prompt_len=8, gen_len=24))
    return uri


def _train(work: Path, uri: str, target, *, kill_at: int | None = None, monkeypatch=None, **kw) -> None:
    if kill_at is not None:
        real = _Trainer._step

        def step_or_die(self, batch, ghost):
            if self.step == kill_at:
                raise Killed()
            return real(self, batch, ghost)

        monkeypatch.setattr(_Trainer, "_step", step_or_die)
    try:
        train(TrainConfig(**{**TINY, **kw}), store_uri=uri, workdir=str(work), target_dir=str(target), seed=0,
              argv=["test"])
    except Killed:
        assert kill_at is not None
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()


def _export(work: Path, target) -> int:
    return serve_main(["export", f"--recipe={ROOT / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={target}"])


def _error(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " WARNING " not in x and " INFO " not in x]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_a_first_run_killed_before_it_finished_says_so(capsys, tmp_path, features, tiny_target, monkeypatch):
    work = tmp_path / "w"
    _train(work, features, tiny_target, kill_at=3, monkeypatch=monkeypatch)
    assert not (work / "train" / "checkpoint.json").exists()
    assert _export(work, tiny_target) == 2
    line = _error(capsys)
    assert f"the training in {work}/train stopped at step 2 before it finished" in line, line
    assert "`train run` again to resume it" in line and not (work / "draft").exists()


def test_an_earlier_runs_checkpoint_beside_a_killed_start_over_is_refused(capsys, tmp_path, features, tiny_target,
                                                                         monkeypatch):
    work = tmp_path / "w"
    _train(work, features, tiny_target)  # finished: checkpoint.json at step 4
    assert json.loads((work / "train" / "checkpoint.json").read_text())["step"] == 4
    assert _export(work, tiny_target) == 0 and is_export(work / "draft")  # a finished run exports
    _train(work, features, tiny_target, kill_at=3, monkeypatch=monkeypatch, num_steps=6, lr=1e-4)  # another recipe
    before = (work / "draft" / "model.safetensors").read_bytes()
    assert _export(work, tiny_target) == 2
    line = _error(capsys)
    assert "stopped at step 2 before it finished" in line and "its checkpoint.json (step 4) is an earlier run's" \
        in line, line
    assert (work / "draft" / "model.safetensors").read_bytes() == before  # the earlier export is left as it was
    _train(work, features, tiny_target, num_steps=6, lr=1e-4)  # resumed to its end
    assert _export(work, tiny_target) == 0
    assert json.loads((work / "train" / "checkpoint.json").read_text())["step"] == 6
