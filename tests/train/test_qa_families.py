"""QA of the three draft families on resume: a key the family does not read (``train.peagle.*`` for
EAGLE-3, ``train.ttt_steps`` for P-EAGLE and DFlash: "ignored", the docs say) does not block a
resume; a changed family does, naming ``train.family``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.train import state as S
from eaglenest.train.config import DFlashConfig, PEagleConfig, StateConfig, TrainConfig
from eaglenest.train.loop import _Trainer, train

TINY = dict(draft_vocab_size=256, ttt_steps=2, pack_tokens=64, batch_rows=2, warmup_steps=1, log_every_steps=1,
            num_steps=4, num_threads=1)


class Killed(Exception):
    """Stands for a SIGKILL in the middle of the loop."""


def run(work: Path, store, target, **kw):
    args = {**TINY, "state": StateConfig(every_steps=2), **kw}
    return train(TrainConfig(**args), store_uri=store[0], workdir=str(work), target_dir=str(target), seed=0,
                 argv=["test"])


def killed_at(work: Path, store, target, monkeypatch, step: int, **kw) -> None:
    real = _Trainer._step

    def step_or_die(self, batch, ghost):
        if self.step == step:
            raise Killed()
        return real(self, batch, ghost)

    monkeypatch.setattr(_Trainer, "_step", step_or_die)
    with pytest.raises(Killed):
        run(work, store, target, **kw)
    monkeypatch.undo()


def steps_logged(work: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (work / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family, unread", [
    ("eagle3", dict(peagle=PEagleConfig(num_slots=3), dflash=DFlashConfig(block_size=4))),
    ("peagle", dict(ttt_steps=5, dflash=DFlashConfig(block_size=4))),
    ("dflash", dict(ttt_steps=5, peagle=PEagleConfig(anchors_per_row=8), dflash=DFlashConfig(num_layers=1))),
])
def test_a_key_the_family_does_not_read_does_not_block_its_resume(tmp_path, feature_store, tiny_target,
                                                                  monkeypatch, caplog, family, unread):
    """Was refused: "cannot resume ... (train.peagle.num_slots 4 -> 3)" for an EAGLE-3 run."""
    work = tmp_path / "w"
    base = dict(family=family, dflash=DFlashConfig(num_layers=1))
    killed_at(work, feature_store, tiny_target, monkeypatch, 3, **base)
    assert json.loads((work / "train" / "state" / "latest.json").read_text())["step"] == 2
    with caplog.at_level(logging.INFO, logger="eaglenest.train.state"):
        s = run(work, feature_store, tiny_target, **{**base, **unread})
    assert "step_00000002 at step 2" in caplog.text  # resumed there, not started over
    assert s.steps == 4 and steps_logged(work) == [1, 2, 3, 4]  # nothing repeated
    trainer = json.loads((work / "train" / "state" / "step_00000004" / "trainer.json").read_text())
    assert trainer["fingerprint"]["train"]["family"] == family


def test_a_changed_family_is_refused_naming_it(tmp_path, feature_store, tiny_target, monkeypatch):
    work = tmp_path / "w"
    killed_at(work, feature_store, tiny_target, monkeypatch, 3)
    with pytest.raises(ConfigError) as e:
        run(work, feature_store, tiny_target, family="peagle")
    assert "\n" not in str(e.value) and "train.family 'eagle3' -> 'peagle'" in str(e.value)
    assert "train.state.resume=never" in str(e.value)


def test_a_state_saved_with_the_unread_keys_still_matches(tmp_path):
    """A fingerprint saved before (every section in it) compares equal on the keys the family reads."""
    now = S.fingerprint(TrainConfig(), table_version=1, store_uri="s3://b/x", target="org/t", seed=0)
    assert not any(k.startswith(("peagle.", "dflash.")) for k in now["train"])
    every_key = S.train_keys(dataclasses.asdict(TrainConfig(peagle=PEagleConfig(num_slots=9))))
    saved = {**now, "train": {k: v for k, v in every_key.items() if k not in S.FREE_KEYS}}
    assert saved["train"]["peagle.num_slots"] == 9
    assert S.resolve({"fingerprint": saved, "step": 1, "path": str(tmp_path / "s")}, now, tmp_path) is not None
    changed = S.fingerprint(TrainConfig(ttt_steps=3), table_version=1, store_uri="s3://b/x", target="org/t", seed=0)
    with pytest.raises(ConfigError, match="train.ttt_steps 7 -> 3"):
        S.resolve({"fingerprint": saved, "step": 1, "path": str(tmp_path / "s")}, changed, tmp_path)
