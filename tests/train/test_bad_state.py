"""Bad or surprising state on disk and bad input, each one line (exit 2) and nothing lost: resume that
does not care how run.target is spelled, a start-over that keeps the old state until the new run has
its own, damaged states, a checkpoint pair from two saves, memory refusals naming the key that drives
them, and `train launch` ranks that refuse their input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.capture import policy
from eaglenest.pipeline import commands
from eaglenest.pipeline.train_cli import main
from eaglenest.recipe import load_recipe
from eaglenest.train import checkpoint, state as S
from eaglenest.train.config import DraftShapeConfig, TrainConfig
from eaglenest.train.loop import _Trainer, train

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "toy.yaml")
TINY = dict(draft_vocab_size=256, ttt_steps=2, pack_tokens=64, batch_rows=2, warmup_steps=1, log_every_steps=1,
            num_steps=2, num_threads=1, state={"every_steps": 1, "keep": 2})


class Killed(Exception):
    """Stands for a SIGKILL in the middle of the loop."""


def cfg(**kw) -> TrainConfig:
    from eaglenest.train.config import StateConfig

    args = {**TINY, **kw}
    args["state"] = StateConfig(**args["state"])
    return TrainConfig(**args)


def run(work: Path, store, target, **kw):
    return train(cfg(**kw), store_uri=store[0], workdir=str(work), target_dir=str(target), seed=0, argv=["test"])


def kill_at(monkeypatch, step: int) -> None:
    """The next run raises inside its loop before training step ``step + 1``."""
    real = _Trainer._step

    def step_or_die(self, batch, ghost):
        if self.step == step:
            raise Killed()
        return real(self, batch, ghost)

    monkeypatch.setattr(_Trainer, "_step", step_or_die)


def latest(work: Path) -> dict:
    return json.loads((work / "train" / "state" / "latest.json").read_text())


def test_fingerprint_compares_folders_not_their_spelling(tmp_path, monkeypatch):
    (tmp_path / "t").mkdir()
    fps = []
    for spelling in (str(tmp_path / "t"), str(tmp_path / "t") + "/", "t", "./t/"):
        monkeypatch.chdir(tmp_path)
        fps.append(S.fingerprint(TrainConfig(), table_version=1, store_uri="s3://b/x", target=spelling, seed=0))
    assert all(fp == fps[0] for fp in fps) and fps[0]["target"] == os.path.realpath(tmp_path / "t")
    hub = S.fingerprint(TrainConfig(), table_version=1, store_uri="s3://b/x", target="org/name", seed=0)
    assert hub["target"] == "org/name" and hub["store_uri"] == "s3://b/x"  # no local path: text
    saved = {**fps[0], "target": str(tmp_path / "t") + "/"}  # a state saved before paths were resolved
    assert S.resolve({"fingerprint": saved, "step": 1, "path": "x"}, fps[0], tmp_path) is not None


def test_a_killed_run_resumes_under_another_spelling_of_the_target(tmp_path, feature_store, tiny_target,
                                                                   monkeypatch):
    work = tmp_path / "w"
    kill_at(monkeypatch, 1)
    with pytest.raises(Killed):
        run(work, feature_store, tiny_target)
    assert latest(work)["step"] == 1
    monkeypatch.undo()
    s = run(work, feature_store, str(tiny_target) + "/")  # was refused: target '/x' -> '/x/'
    assert s.steps == 2 and latest(work)["step"] == 2
    lines = (work / "train" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    monkeypatch.chdir(Path(tiny_target).parent)
    again = run(work, feature_store, Path(tiny_target).name)  # relative: a finished run, nothing to do
    assert again.steps == 2 and (work / "train" / "metrics.jsonl").read_text().splitlines() == lines


def test_a_start_over_keeps_the_old_state_until_the_new_run_has_one(tmp_path, feature_store, tiny_target,
                                                                    monkeypatch):
    work = tmp_path / "w"
    run(work, feature_store, tiny_target)  # finished: lr 3e-3
    old = checkpoint.read_info(work / "train")["weights_sha256"]
    metrics = (work / "train" / "metrics.jsonl").read_text()
    assert [json.loads(x)["step"] for x in metrics.splitlines()] == [1, 2]
    kill_at(monkeypatch, 0)
    with pytest.raises(Killed):  # another recipe starts over and is killed before its first state
        run(work, feature_store, tiny_target, lr=1e-3)
    aside = work / "train" / "state.previous"
    assert json.loads((aside / "latest.json").read_text())["step"] == 2
    assert (aside / S.BOOKS / "metrics.jsonl").read_text() == metrics  # the run's metrics went aside with it
    monkeypatch.undo()
    back = run(work, feature_store, tiny_target)  # the first recipe again: its finished state, nothing to do
    assert back.steps == 2 and latest(work)["step"] == 2 and not aside.exists()
    assert (work / "train" / "metrics.jsonl").read_text() == metrics  # and came back with it
    assert checkpoint.read_info(work / "train")["weights_sha256"] == old  # the same weights
    other = run(work, feature_store, tiny_target, lr=1e-3)  # the other recipe, to the end: the old state goes
    assert other.steps == 2 and not aside.exists()
    info = json.loads((work / "train" / "state" / "step_00000002" / "trainer.json").read_text())
    assert info["fingerprint"]["train"]["lr"] == 1e-3


def test_a_moved_workdir_with_its_store_resumes_instead_of_training_again(tmp_path, feature_store, tiny_target):
    """The fingerprint holds the store's resolved path: a workdir copied or renamed with its store
    inside looked like another recipe, and its finished run was trained again from step 0."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(feature_store[0], a / "store")
    run(a, (str(a / "store"), feature_store[1]), tiny_target)
    shutil.copytree(a, b)
    before = {p.relative_to(b): p.read_bytes() for p in (b / "train").rglob("*") if p.is_file()}
    again = run(b, (str(b / "store"), feature_store[1]), tiny_target)
    assert again.steps == 2 and not (b / "train" / "state.previous").exists()
    after = {p.relative_to(b): p.read_bytes() for p in (b / "train").rglob("*") if p.is_file()}
    assert after[Path("train/metrics.jsonl")] == before[Path("train/metrics.jsonl")]
    state = Path("train/state/step_00000002/trainer.json")
    assert after[state] == before[state]  # not saved again
    # a store elsewhere (not where it was beside the state) is another recipe: a finished run starts over
    other = tmp_path / "other-store"
    shutil.copytree(feature_store[0], other)
    assert run(b, (str(other), feature_store[1]), tiny_target).steps == 2
    assert json.loads((b / "train" / "state" / "step_00000002" / "trainer.json").read_text())["fingerprint"][
        "store_uri"] == str(other.resolve())


@pytest.fixture(scope="module")
def finished(tmp_path_factory, feature_store, tiny_target):
    work = tmp_path_factory.mktemp("finished") / "w"
    run(work, feature_store, tiny_target)
    return work


def damaged_copy(finished: Path, tmp_path: Path) -> Path:
    work = tmp_path / "w"
    shutil.copytree(finished, work)
    return work


@pytest.mark.parametrize("damage, names", [
    (lambda st: (st / "latest.json").write_text("{not json"), "latest.json"),
    (lambda st: (st / "latest.json").write_text('{"step": 9, "dir": "step_00000009"}'), "trainer.json"),
    (lambda st: (st / "latest.json").write_text("[1, 2]"), "latest.json"),
    (lambda st: (st / "step_00000002" / "trainer.json").write_text("\x00garbage"), "trainer.json"),
    (lambda st: (st / "step_00000002" / "trainer.json").write_text('{"step": "x"}'), "trainer.json"),
])
def test_a_damaged_state_is_one_line_naming_the_file(tmp_path, finished, damage, names):
    work = damaged_copy(finished, tmp_path)
    damage(work / "train" / "state")
    with pytest.raises(StoreError) as e:
        S.read_latest(work / "train" / "state")
    line = str(e.value)
    assert "\n" not in line and names in line and "train.state.resume=never" in line


def test_a_truncated_shard_is_one_line_and_resume_never_starts_over(tmp_path, finished, feature_store,
                                                                    tiny_target):
    work = damaged_copy(finished, tmp_path)
    shard = work / "train" / "state" / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(StoreError) as e:
        run(work, feature_store, tiny_target)
    assert "\n" not in str(e.value) and "step_00000002" in str(e.value)
    assert "train.state.resume=never" in str(e.value)
    assert run(work, feature_store, tiny_target, state={"every_steps": 1, "keep": 2, "resume": "never"}).steps == 2


def test_weights_of_another_save_are_refused(tmp_path, finished, tiny_target):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(finished / "train", a)
    model, info = checkpoint.load_checkpoint(a, target_dir=tiny_target)
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    checkpoint.save_checkpoint(b, model, info={k: v for k, v in info.items() if k not in ("format",)})
    assert checkpoint.load_checkpoint(b)[0] is not None  # a pair from one save loads
    shutil.copy(a / checkpoint.WEIGHTS, b / checkpoint.WEIGHTS)  # a kill between the two renames
    with pytest.raises(StoreError, match="not the ones checkpoint.json describes"):
        checkpoint.read_info(b)
    (b / checkpoint.WEIGHTS).write_bytes(b"\x00" * 7)
    with pytest.raises(StoreError, match="cannot read the draft weights"):
        checkpoint.load_checkpoint(b)


def test_the_same_weights_save_to_the_same_bytes(tmp_path, finished, tiny_target):
    """safetensors writes its metadata keys in hash-map order; the checkpoint sorts them, so saving the
    same weights again gives a byte-identical file (8 saves: unsorted, they differ almost surely)."""
    model, info = checkpoint.load_checkpoint(finished / "train", target_dir=tiny_target)
    info = {k: v for k, v in info.items() if k != "format"}
    blobs = {checkpoint.save_checkpoint(tmp_path / f"c{i}", model, info=info).joinpath(checkpoint.WEIGHTS).read_bytes()
             for i in range(8)}
    assert len(blobs) == 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "c0" / checkpoint.WEIGHTS), "pt") as f:
        assert sorted(f.metadata()) == ["format", "weights_sha256"]
        assert f.metadata()["weights_sha256"] == checkpoint.read_info(tmp_path / "c0")["weights_sha256"]
    assert checkpoint.load_checkpoint(tmp_path / "c0")[0].fc.weight.equal(model.fc.weight)


@pytest.mark.parametrize("overrides, key", [
    (["train.ttt_steps=200"], "train.ttt_steps"),
    (["train.family=peagle", "train.peagle.num_slots=512"], "train.peagle.num_slots"),
    (["train.family=dflash", "train.dflash.block_size=512"], "train.dflash.block_size"),
    (["train.batch_rows=100000"], "train.batch_rows"),
    (["train.pack_tokens=50000000"], "train.pack_tokens"),
])
def test_the_memory_refusal_names_the_key_that_drives_it(overrides, key):
    """(A P-EAGLE/DFlash depth past a packed row, 512 tokens here, is refused when the recipe loads; anchors
    count up to a row's tokens, so anchors_per_row alone never drives it: tests/common/test_memfit.py.)"""
    recipe = load_recipe(RECIPE, overrides)
    with pytest.raises(ConfigError) as e:
        commands.check_fit(recipe, available=8 << 30)  # none is run: estimates only
    assert str(e.value).startswith(f"{key}: a training step") and str(e.value).endswith(f"lower {key}")
    commands.check_fit(load_recipe(RECIPE, overrides[:1] if len(overrides) > 1 else []), available=8 << 30)


def test_keys_whose_defaults_do_not_go_together_still_get_the_memory_refusal():
    """``num_attention_heads`` and ``num_key_value_heads`` both huge: setting either back to its default
    alone breaks the heads' ratio, and that ConfigError ("4 attention heads are not a multiple of
    1000000 key/value heads": heads the user never typed) escaped instead of the memory line."""
    recipe = load_recipe(RECIPE, ["train.draft.num_attention_heads=1000000", "train.draft.num_key_value_heads=1000000"])
    with pytest.raises(ConfigError, match=r"^train\.\w+: a training step .* more than the 8\.00 GiB of memory"):
        commands.check_fit(recipe, available=8 << 30)


def test_draft_vocab_past_the_target_vocab_is_a_range_error_first():
    with pytest.raises(ConfigError, match=r"^train.draft_vocab_size: 999999 must be in \[2, 2048\]"):
        commands.check_fit(load_recipe(RECIPE, ["train.draft_vocab_size=999999"]), available=1)


def test_parallel_families_count_their_slots():
    from eaglenest import memfit

    base = dict(pack_tokens=512, rows=4, hidden=128, num_aux=3, heads=4, head_dim=32, intermediate=384,
                draft_vocab=1024, target_vocab=2048, ttt_steps=1, attn_chunk_tokens=2048, target_chunk_tokens=2048)
    plain = memfit.train_estimate(**base).total_bytes
    peagle = memfit.train_estimate(**base, slots=64 * 3).total_bytes
    bigger = memfit.train_estimate(**base, slots=64 * 99).total_bytes
    assert plain < peagle < bigger
    dflash = memfit.train_estimate(**base, slots=32 * 8, layers=2, context_queries=False)
    assert dflash.parts["attention_scores"] == 2 * 4 * 4 * 256 * (512 + 256) * 4


def test_small_input_checks():
    with pytest.raises(ConfigError, match="^train.draft.head_dim: an even number"):
        DraftShapeConfig(head_dim=7)
    DraftShapeConfig(head_dim=8)
    with pytest.raises(ConfigError, match="^run.target: /nonexistent/target does not exist"):
        policy.require_target_folder("/nonexistent/target")
    policy.require_target_folder("org/name")  # a hub id: left to the download
    policy.require_target_folder(str(ROOT / "assets" / "tiny-target"))


@pytest.mark.parametrize("key", ["track.dir", "select.split"])
def test_bad_track_dir_or_select_split_is_one_line_before_any_work(tmp_path, feature_store, tiny_target, capsys,
                                                                   key):
    work = tmp_path / "w"
    afile = tmp_path / "a-file"
    afile.write_text("x")
    extra = {"track.dir": [f"train.track.dir={afile}"],
             "select.split": ["train.select.every_steps=1", "train.select.split=nosuch"]}[key]
    rc = main(["run", "--recipe", RECIPE, f"run.workdir={work}", f"run.target={tiny_target}",
               f"run.store={feature_store[0]}", "train.num_steps=1", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"error: train.{key}:" in err[0], err
    assert not work.exists() or not any(work.rglob("*"))


def test_many_epochs_build_only_the_batches_num_steps_needs(tmp_path, feature_store, tiny_target):
    assert run(tmp_path / "w", feature_store, tiny_target, num_epochs=100000).steps == 2


def test_launch_with_ranks_refusing_their_input_exits_2_without_a_traceback(tmp_path, feature_store, tiny_target):
    cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "2", "--recipe", RECIPE,
           f"run.workdir={tmp_path / 'w'}", f"run.target={tiny_target}", f"run.store={feature_store[0]}",
           "train.num_steps=1", "train.table_version=99", "train.num_threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-4000:]
    assert "error: " in proc.stderr and "99" in proc.stderr
