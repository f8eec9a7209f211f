"""QA pass 12 on checkpoint selection by served AL: a snapshot whose served AL could not be measured.

A served AL is undefined when no draft round ran (every output ended at its prefill token, e.g.
``evaluate.max_tokens=1``): ``evaluate al`` reports it as null. Selection must not read that as a
number (0.0) and keep such a snapshot as the run's best.
"""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import StoreError
from eaglenest.train.checkpoint import INFO, load_checkpoint
from eaglenest.train.config import SelectConfig
from eaglenest.train.selection import SELECTION, Selector, read_jsonl, write_report


@pytest.fixture()
def draft(toy_checkpoint, tiny_target):
    return load_checkpoint(toy_checkpoint, target_dir=str(tiny_target))[0]


def _mark(draft, step: int):
    import torch

    with torch.no_grad():
        draft.fc.weight[0, 0] = float(step)
    return draft


def _selector(outdir, als: dict, target) -> Selector:
    def score(snapshot):
        return {"served_al": als[json.loads((snapshot / INFO).read_text())["step"]], "prompts": 2}

    return Selector(outdir, cfg=SelectConfig(every_steps=2), score=score, target_dir=str(target), active=True,
                    resume_step=0)


def test_an_unmeasured_served_al_is_recorded_as_none_and_never_kept_as_best(tmp_path, draft, tiny_target):
    """Selector.evaluate wrote ``served_al: 0.0`` for a snapshot vLLM measured no round of, kept it as best/,
    and the run's checkpoint became that snapshot (``best_served_al: 0.0``) instead of its last step."""
    sel = _selector(tmp_path, {2: None, 4: None}, tiny_target)
    assert sel.evaluate(2, _mark(draft, 2), info={"step": 2}) is None
    assert sel.evaluate(4, _mark(draft, 4), info={"step": 4}) is None
    assert [(r["step"], r["served_al"]) for r in read_jsonl(tmp_path / SELECTION)] == [(2, None), (4, None)]
    assert sel.best() is None
    model, info = sel.finish(_mark(draft, 5), {"step": 5})
    assert "selection" not in info and float(model.fc.weight[0, 0].detach()) == 5.0
    report = json.loads(write_report(tmp_path, stall_fraction=0.0, tokens_per_second=1.0).read_text())
    assert report["best"] is None and [r["served_al"] for r in report["served_al"]] == [None, None]


def test_a_measured_snapshot_after_an_unmeasured_one_is_the_best(tmp_path, draft, tiny_target):
    sel = _selector(tmp_path, {2: None, 4: 1.25, 6: None}, tiny_target)
    for step in (2, 4, 6):
        sel.evaluate(step, _mark(draft, step), info={"step": step})
    assert (sel.best()["step"], sel.best()["served_al"]) == (4, 1.25)
    model, info = sel.finish(_mark(draft, 7), {"step": 7})
    assert (info["selection"]["best_step"], info["selection"]["best_served_al"]) == (4, 1.25)
    assert float(model.fc.weight[0, 0].detach()) == 4.0


def test_a_resume_at_an_evaluated_step_keeps_its_record_and_its_best(tmp_path, draft, tiny_target):
    """A run resumed at step 4 (its state saved after step 4's evaluation) keeps step 4's record and best/,
    and does not serve step 4 again."""
    first = _selector(tmp_path, {2: 1.5, 4: 2.0}, tiny_target)
    for step in (2, 4):
        first.evaluate(step, _mark(draft, step), info={"step": step})
    resumed = _selector_resumed(tmp_path, tiny_target, 4)
    assert [r["step"] for r in read_jsonl(tmp_path / SELECTION)] == [2, 4]
    assert (resumed.best()["step"], resumed.best()["served_al"]) == (4, 2.0)
    assert resumed.evaluate(4, _mark(draft, 4), info={"step": 4}) is None  # already evaluated: not served again
    resumed_earlier = _selector_resumed(tmp_path, tiny_target, 2)  # step 4 is trained again: its best/ goes
    assert [r["step"] for r in read_jsonl(tmp_path / SELECTION)] == [2]
    assert resumed_earlier.best() is None


def _selector_resumed(outdir, target, resume_step: int) -> Selector:
    def score(snapshot):
        raise AssertionError(f"{snapshot} served again")

    return Selector(outdir, cfg=SelectConfig(every_steps=2), score=score, target_dir=str(target), active=True,
                    resume_step=resume_step)


def test_a_damaged_line_inside_selection_jsonl_is_refused_not_dropped(tmp_path):
    """Only the last line may be cut short (a kill mid-append); a bad line before it is damage, refused."""
    path = tmp_path / SELECTION
    path.write_text('{"step": 2, "served_al": 1.5}\n{"step": 4, "serv\n{"step": 6, "served_al": 1.7}\n')
    with pytest.raises(StoreError, match="line 2"):
        read_jsonl(path)
    path.write_text('{"step": 2, "served_al": 1.5}\n{"step": 4, "serv')
    assert [r["step"] for r in read_jsonl(path)] == [2]
