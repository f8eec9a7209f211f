"""QA of the trainer on odd but legal inputs (hostile pass 9): each test failed before its fix."""

from __future__ import annotations

import json

import pytest

from eaglenest.errors import StoreError
from eaglenest.train.config import StateConfig, TrainConfig
from eaglenest.train.loop import _Trainer, train

TINY = dict(draft_vocab_size=64, ttt_steps=2, pack_tokens=32, batch_rows=2, warmup_steps=1, log_every_steps=1,
            num_steps=2, num_threads=1)


def run(work, uri, target, **kw):
    args = {**TINY, "state": StateConfig(every_steps=25), **kw}
    return train(TrainConfig(**args), store_uri=uri, workdir=str(work), target_dir=str(target), seed=0, argv=["test"])


def test_samples_too_short_to_predict_anything_are_not_blamed_on_pack_tokens(tmp_path, synth, tiny_target):
    """Samples of 1-2 tokens (every one whole in its row of 32) have no position t whose token t+2 exists: the
    refusal said their loss tokens "lie past train.pack_tokens=32" and told the user to raise it, which changes
    nothing."""
    uri = str(tmp_path / "store")
    synth.write_features(uri, tiny_target, [([5], [1]), ([5, 6], [0, 1]), ([7, 8], [1, 1])])
    work = tmp_path / "w"
    with pytest.raises(StoreError) as e:
        run(work, uri, tiny_target)
    msg = str(e.value)
    assert msg.startswith("steps 1-2: no position to train on") and "\n" not in msg
    assert "pack_tokens" not in msg and "third position" in msg
    assert not (work / "train" / "draft.safetensors").exists() and not (work / "train" / "state").exists()


class Killed(Exception):
    """Stands for a SIGKILL (or an out-of-memory kill) in the middle of the loop."""


def test_a_run_killed_for_memory_resumes_with_smaller_chunks(tmp_path, feature_store, tiny_target, monkeypatch):
    """The way out of an out-of-memory kill is a smaller train.attn_chunk_tokens / train.target_chunk_tokens (the
    docs: they bound activation memory and change results only by summation order, as train.num_threads does).
    The resume was refused ("cannot resume ... train.attn_chunk_tokens 2048 -> 16"), so the run's steps were lost.
    Resumed with both at 16 positions (rows of 64: every chunked path runs), it continues the same trajectory."""
    kw = dict(pack_tokens=64, num_steps=4, state=StateConfig(every_steps=2))
    real = _Trainer._step

    def die_at_step_2(self, batch, ghost):
        if self.step == 2:
            raise Killed()
        return real(self, batch, ghost)

    monkeypatch.setattr(_Trainer, "_step", die_at_step_2)
    with pytest.raises(Killed):
        run(tmp_path / "killed", feature_store[0], tiny_target, **kw)
    monkeypatch.undo()
    resumed = run(tmp_path / "killed", feature_store[0], tiny_target, attn_chunk_tokens=16, target_chunk_tokens=16,
                  **kw)
    whole = run(tmp_path / "whole", feature_store[0], tiny_target, **kw)
    a, b = metrics(tmp_path / "killed"), metrics(tmp_path / "whole")
    assert resumed.steps == whole.steps == 4 and [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3, 4]
    assert a[:2] == b[:2]  # the steps before the kill, kept
    for x, y in zip(a[2:], b[2:]):  # after it: the same steps, summed in another order
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4) and x["step_count"] == y["step_count"]
        assert x["lr"] == y["lr"] and x["tokens"] == y["tokens"]  # the schedule and the samples go on where they were


def metrics(work) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in ("seconds", "tokens_per_second", "stall_fraction")}
            for x in (work / "train" / "metrics.jsonl").read_text().splitlines()]
