"""Training curves where people look: `train run` writes TensorBoard event files (read back with
TensorBoard's own reader), reports to W&B (offline) and trackio (its local store) when the recipe
names one; a resumed run does not log a step twice; a tracker that is not installed is one line."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import sys
from pathlib import Path

import pytest

from eaglenest.config import apply_overrides, build
from eaglenest.errors import ConfigError
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.train import state as S
from eaglenest.train.config import TrackConfig, TrainConfig
from eaglenest.train.track import cut_events

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml")
NUM_STEPS, TTT = 4, 3
TAGS = {"train/loss", "train/lr", "train/epoch", "perf/tokens_per_s", "perf/data_stall",
        *(f"acc/pos{i}" for i in range(TTT))}


def argv(workdir: Path, store, target, *extra: str) -> list[str]:
    uri, version = store
    return ["run", "--recipe", RECIPE, f"run.workdir={workdir}", f"run.target={target}", f"run.store={uri}",
            f"train.table_version={version}", f"train.num_steps={NUM_STEPS}", f"train.ttt_steps={TTT}",
            "train.draft_vocab_size=256", "train.pack_tokens=128", "train.batch_rows=2", "train.log_every_steps=1",
            "train.warmup_steps=1", *extra]


def metrics(outdir: Path) -> list[dict]:
    return [json.loads(x) for x in (outdir / "metrics.jsonl").read_text().splitlines()]


def read_tensorboard(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return acc


def test_tensorboard_event_files_hold_the_logged_metrics(tmp_path, feature_store, tiny_target):
    assert train_main(argv(tmp_path, feature_store, tiny_target)) == 0
    out = tmp_path / "train"
    acc = read_tensorboard(out / "tensorboard")
    assert TAGS <= set(acc.Tags()["scalars"])
    logged = metrics(out)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [m["step"] for m in logged] == list(range(1, NUM_STEPS + 1))
    # Event files hold float32: the values are the log's, to float32 precision.
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in logged], rel=1e-6)
    assert loss[-1].value == pytest.approx(json.loads((out / "checkpoint.json").read_text())["metrics"]["loss"],
                                           rel=1e-6)
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([m["lr"] for m in logged], rel=1e-6)
    for i in range(TTT):
        values = [e.value for e in acc.Scalars(f"acc/pos{i}")]
        assert values == pytest.approx([m["step_acc"][i] for m in logged], abs=1e-6)
        assert all(0.0 <= v <= 1.0 for v in values)
    assert all(e.value > 0 for e in acc.Scalars("perf/tokens_per_s"))
    assert all(0.0 <= e.value <= 1.0 for e in acc.Scalars("perf/data_stall"))
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer: rank 0


def test_resumed_run_logs_each_step_once(tmp_path, feature_store, tiny_target):
    """What a SIGKILL after step 4 leaves (the last state at step 2, metrics and events of steps 3
    and 4 written): the resumed run cuts the event files back to step 2 and logs 3 and 4 once."""
    cmd = argv(tmp_path, feature_store, tiny_target, "train.state.every_steps=2")
    assert train_main(cmd) == 0
    state = tmp_path / "train" / "state"
    (state / "latest.json").write_text(json.dumps({"step": 2, "dir": "step_00000002"}))
    assert train_main(cmd) == 0
    logdir = tmp_path / "train" / "tensorboard"
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2  # the first run's (cut) and the resumed one's
    loss = read_tensorboard(logdir).Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, NUM_STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in metrics(tmp_path / "train")], rel=1e-6)
    assert train_main(cmd) == 0  # finished: nothing left to do, no writer, no new file
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 2
    # A fresh start (another seed, resume off) empties the folder: steps 1..4 once, of the new run.
    assert train_main([*cmd, "train.state.resume=never", "train.seed=7"]) == 0
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    loss = read_tensorboard(logdir).Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, NUM_STEPS + 1))
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in metrics(tmp_path / "train")], rel=1e-6)


def wandb_history(records) -> dict[str, dict[int, float]]:
    """key -> {step: value} of the history ``records`` of a W&B offline run file (``wandb_log.records``)."""
    out = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in record.history.item}
            step = record.history.step.num if record.history.HasField("step") else items.get("_step")
            for key, value in items.items():
                out.setdefault(key, {})[int(step)] = value
    return out


def test_wandb_offline_receives_the_loss_series(tmp_path, feature_store, tiny_target, monkeypatch, wandb_log):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing in the user's home
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    assert train_main(argv(tmp_path, feature_store, tiny_target, "train.track.tracker=wandb",
                           "train.track.mode=offline", "train.track.project=eaglenest-test")) == 0
    # wandb's service process writes the run file on its own time; it is complete once W&B is torn
    # down, which a `train run` process does when it exits (wandb's atexit hook), here explicitly.
    import wandb

    wandb.teardown()
    out = tmp_path / "train"
    [run_file] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    history = wandb_history(wandb_log.records(run_file))
    assert "train/loss" in history, (run_file.stat().st_size, sorted(history))
    assert {m["step"]: pytest.approx(m["loss"]) for m in metrics(out)} == history["train/loss"]
    assert set(history) >= TAGS


def test_trackio_local_store_receives_the_loss_series(tmp_path, feature_store, tiny_target, monkeypatch):
    # trackio reads TRACKIO_DIR once, when imported: the product leaves it alone, the test sets it.
    assert "trackio" not in sys.modules, "trackio imported before this test: TRACKIO_DIR would be ignored"
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    assert train_main(argv(tmp_path, feature_store, tiny_target, "train.track.tracker=trackio",
                           "train.track.project=eaglenest-test", "train.track.run_name=toy-run")) == 0
    with sqlite3.connect(tmp_path / "trackio" / "eaglenest-test.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY step").fetchall()
    assert {r[0] for r in rows} == {"toy-run"}
    got = {step: json.loads(blob)["train/loss"] for _, step, blob in rows if "train/loss" in json.loads(blob)}
    assert got == {m["step"]: pytest.approx(m["loss"]) for m in metrics(tmp_path / "train")}


def test_missing_or_unknown_tracker_is_one_line_before_any_work(tmp_path, feature_store, tiny_target,
                                                               monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module as not importable
    assert train_main(argv(tmp_path, feature_store, tiny_target, "train.track.tracker=wandb")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.track.tracker=wandb" in err and "pip install wandb" in err, err
    assert not (tmp_path / "train").exists()  # refused before the run started
    assert train_main(argv(tmp_path, feature_store, tiny_target, "train.track.tracker=mlflow")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.track.tracker" in err and "mlflow" in err, err


@pytest.mark.parametrize("override, message", [
    ("train.track.mode=cloud", "train.track.mode: 'cloud' is not one of 'online', 'offline'"),
    ("train.track.dir=''", "train.track.dir: a folder"),
    ("train.track.project=''", "train.track.project"),
    ("train.tracker=wandb", "train.tracker: unknown key"),
])
def test_track_section_errors_name_the_key(override, message):
    data = apply_overrides({}, ["train.track.tracker=wandb", override]).get("train")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build(TrainConfig, data, where="train")


def test_track_keys_do_not_change_the_resume_fingerprint():
    """Turning a tracker on, or moving the event files, keeps the run resumable."""
    other = TrackConfig(tensorboard=False, dir="tb", tracker="trackio", project="p", run_name="r", mode="offline")
    assert {f.name for f in dataclasses.fields(TrackConfig)} == {k.split(".")[1] for k in S.FREE_KEYS
                                                                if k.startswith("track.")}
    fps = [S.fingerprint(cfg, table_version=1, store_uri="s", target="t", seed=0)
           for cfg in (TrainConfig(), TrainConfig(track=other))]
    assert fps[0] == fps[1]


def test_cut_events_drops_a_torn_tail_and_the_steps_past_the_state(tmp_path):
    """A file a kill cut mid-record is rewritten without the torn record; a resume at step 3 keeps
    steps 1..3 (TensorBoard's own writer and reader on both sides)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for step in range(1, 6):
        writer.add_scalar("train/loss", float(step), step)
    writer.close()
    [events] = list(tmp_path.glob("events.out.tfevents.*"))
    size = events.stat().st_size
    with open(events, "r+b") as f:
        f.truncate(size - 5)  # the last record, torn
    cut_events(tmp_path, 9)
    assert [e.step for e in read_tensorboard(tmp_path).Scalars("train/loss")] == [1, 2, 3, 4]
    assert events.stat().st_size < size - 5
    cut_events(tmp_path, 3)
    loss = read_tensorboard(tmp_path).Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [p.name for p in tmp_path.iterdir()] == [events.name]
    cut_events(tmp_path, 0)  # a fresh start
    assert not list(tmp_path.iterdir())


def test_cut_events_warns_and_keeps_the_bytes_of_an_unreadable_event_file(tmp_path, caplog):
    """A damaged event file (nothing readable) is not silently rewritten empty: a warning names it and
    its bytes stay beside it under a name TensorBoard does not read."""
    events = tmp_path / "events.out.tfevents.1700000000.host.1.0"
    garbage = b"\x07" * 300
    events.write_bytes(garbage)
    with caplog.at_level("WARNING"):
        cut_events(tmp_path, 3)
    assert f"{events}: 300 of its 300 bytes after its 0 whole record(s) are not readable" in caplog.text
    [kept] = [p for p in tmp_path.iterdir() if p != events]
    assert kept.read_bytes() == garbage and "tfevents" not in kept.name
    read_tensorboard(tmp_path)  # TensorBoard still loads the folder
