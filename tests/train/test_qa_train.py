"""QA of the trainer's books, resume and launch: each found by a hostile run, each one line (exit 2)
and nothing lost or repeated."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.train import state as S
from eaglenest.train.config import DFlashConfig, PEagleConfig, StateConfig, TrainConfig
from eaglenest.train.loop import _Trainer, train

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "toy.yaml")
TINY = dict(draft_vocab_size=256, ttt_steps=2, pack_tokens=64, batch_rows=2, warmup_steps=1, log_every_steps=1,
            num_steps=4, num_threads=1)


class Killed(Exception):
    """Stands for a SIGKILL in the middle of the loop."""


def run(work: Path, store, target, **kw):
    args = {**TINY, "state": StateConfig(every_steps=2), **kw}
    return train(TrainConfig(**args), store_uri=store[0], workdir=str(work), target_dir=str(target), seed=0,
                 argv=["test"])


def killed_at(work: Path, store, target, monkeypatch, step: int, **kw) -> None:
    """A run that dies before training step ``step + 1`` (its last state: the one before)."""
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


def test_a_torn_metrics_line_is_left_out_on_resume(tmp_path, feature_store, tiny_target, monkeypatch):
    """A kill (or a full disk) while a metrics line was appended leaves it cut short; the resume read
    the file whole and died in json with a traceback."""
    work = tmp_path / "w"
    killed_at(work, feature_store, tiny_target, monkeypatch, 3)
    assert steps_logged(work) == [1, 2, 3]
    with (work / "train" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "epo')  # the append of step 4, cut short
    assert run(work, feature_store, tiny_target).steps == 4
    assert steps_logged(work) == [1, 2, 3, 4]


def test_a_damaged_metrics_line_is_one_line_naming_the_file(tmp_path, feature_store, tiny_target, monkeypatch):
    work = tmp_path / "w"
    killed_at(work, feature_store, tiny_target, monkeypatch, 3)
    path = work / "train" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(StoreError) as e:
        run(work, feature_store, tiny_target)
    assert "\n" not in str(e.value) and "metrics.jsonl: line 2" in str(e.value)
    assert "train.state.resume=never" in str(e.value)


def test_launch_on_a_rendezvous_port_in_use_is_one_line(tmp_path, feature_store, tiny_target):
    """Node 0 hosts the c10d store at --rdzv-endpoint: a port already taken gave torchrun's
    RendezvousConnectionError traceback (exit 1)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        endpoint = f"127.0.0.1:{busy.getsockname()[1]}"
        cmd = [sys.executable, "-m", "eaglenest.pipeline.train_cli", "launch", "--nproc", "1", "--nnodes", "1",
               "--rdzv-endpoint", endpoint, "--node-rank", "0", "--recipe", RECIPE, f"run.workdir={tmp_path / 'w'}",
               f"run.target={tiny_target}", f"run.store={feature_store[0]}", "train.num_steps=1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert len(errors) == 1 and f"--rdzv-endpoint {endpoint}" in errors[0] and "EADDRINUSE" in errors[0], errors
    assert not (tmp_path / "w" / "train").exists()


@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_rows_too_short_to_train_anything_are_refused(family):
    """pack_tokens=2 truncated every sample to 2 tokens: every family "trained" with loss 0.0 on no
    position and saved the initial weights as a checkpoint."""
    with pytest.raises(ConfigError) as e:
        TrainConfig(pack_tokens=2, family=family)
    assert str(e.value).startswith("train.pack_tokens: must be >= 3") and str(e.value).endswith("got 2")
    shallow = {"eagle3": {"ttt_steps": 3}, "peagle": {"peagle": PEagleConfig(num_slots=3)},
               "dflash": {"dflash": DFlashConfig(block_size=3)}}
    assert TrainConfig(pack_tokens=3, family=family, **shallow.get(family, {})).pack_tokens == 3  # (depth <= row)


def test_a_second_run_of_the_same_folder_is_refused_while_the_first_runs(tmp_path, feature_store, tiny_target):
    """`train run` launched twice on one workdir: the second resumed the first's state while it ran,
    both trained and logged the same steps and saved the same state folder."""
    work = tmp_path / "w"
    (work / "train").mkdir(parents=True)
    with (work / "train" / ".lock").open("a") as first:  # what the running `train run` holds
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StoreError) as e:
            run(work, feature_store, tiny_target)
    assert "\n" not in str(e.value) and str(work / "train") in str(e.value) and "another `train run`" in str(e.value)
    assert sorted(p.name for p in (work / "train").iterdir()) == [".lock"]  # it wrote nothing
    assert run(work, feature_store, tiny_target).steps == 4  # once the first is gone
    assert steps_logged(work) == [1, 2, 3, 4]


def _truncate(t: Path) -> str:
    w = t / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return "model.safetensors"


def _header_only(t: Path) -> str:
    (t / "model.safetensors").write_bytes(b"\x00" * 3)
    return "model.safetensors"


def _bad_index(t: Path) -> str:
    (t / "model.safetensors.index.json").write_text("{bad")
    return "model.safetensors.index.json"


def _index_without_map(t: Path) -> str:
    (t / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return "model.safetensors.index.json"


def _index_naming_a_missing_shard(t: Path) -> str:
    names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    (t / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shard-2.safetensors"
                                                                               for n in names}}))
    return "shard-2.safetensors"


@pytest.mark.parametrize("damage", [_truncate, _header_only, _bad_index, _index_without_map,
                                    _index_naming_a_missing_shard])
def test_damaged_target_weights_are_one_line_naming_the_file(tmp_path, tiny_target, damage):
    """An interrupted download of run.target: safetensors', json's or the OS's traceback before."""
    from eaglenest.train.target import load_target_tensors

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    name = damage(target)
    with pytest.raises(ConfigError) as e:
        load_target_tensors(target)
    line = str(e.value)
    assert "\n" not in line and line.startswith(("run.target: ", str(target))), line
    assert name in line and "download them again" in line, line


def test_train_on_a_truncated_target_is_one_line(tmp_path, feature_store, tiny_target):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    _truncate(target)
    with pytest.raises(ConfigError, match=r"^run.target: cannot read .*model.safetensors"):
        run(tmp_path / "w", feature_store, target)


def test_a_checkpoint_save_leaves_no_temporary_weights(tmp_path, monkeypatch):
    """A save killed (or out of disk) mid-write left `.draft.safetensors.tmp<pid>`, a whole draft's
    size, in the run's folder for good: one more per interrupted save."""
    import errno

    from eaglenest.train import checkpoint
    from eaglenest.train.model import Eagle3Draft, draft_config
    from eaglenest.train.spec import DraftFlags

    cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 128}
    model = Eagle3Draft(draft_config(cfg, draft_vocab_size=16, layer_ids=(1, 2, 3), flags=DraftFlags()))
    out = tmp_path / "ckpt"
    out.mkdir()
    prefix = ".draft.safetensors.tmp"  # the weights' temporary name: this prefix and the saving process's id
    gone, alive = out / f"{prefix}{2**22 + 1}", out / f"{prefix}{os.getpid()}x"
    gone.write_bytes(b"\x00" * 64)  # a killed save's (no process has that id: above Linux's pid_max)
    alive.write_bytes(b"")  # not a pid: not ours to judge
    checkpoint.save_checkpoint(out, model, info={"step": 1})
    assert not gone.exists() and alive.exists() and checkpoint.read_info(out)["step"] == 1
    real = Path.write_bytes

    def full_disk(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(out, model, info={"step": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(prefix)) == [alive.name]
    assert checkpoint.read_info(out)["step"] == 1  # the previous pair is intact


@pytest.fixture(scope="module")
def poisoned_store(tmp_path_factory, synth, tiny_target):
    """4 samples, one aux value of the first one infinite (a capture that overflowed)."""
    real = synth.compute_features

    def poisoned(target_dir, sequences, layer_ids=synth.LAYER_IDS):
        out = real(target_dir, sequences, layer_ids)
        aux = out[0][0].copy()
        aux[5, 0, 3] = float("inf")
        return [(aux, out[0][1]), *out[1:]]

    uri = str(tmp_path_factory.mktemp("poisoned") / "store")
    samples = synth.greedy_sequences(tiny_target, n=4, prompt_len=8, gen_len=24)
    synth.compute_features = poisoned
    try:
        version = synth.write_features(uri, tiny_target, samples)
    finally:
        synth.compute_features = real
    return uri, version


@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_non_finite_features_stop_the_run_before_it_saves_a_nan_draft(tmp_path, poisoned_store, tiny_target, family):
    """One inf in the features made the loss NaN; the run went on and saved an all-NaN draft (exit 0)."""
    work = tmp_path / "w"
    with pytest.raises(StoreError) as e:
        run(work, poisoned_store, tiny_target, family=family, num_steps=2)
    line = str(e.value)
    assert "\n" not in line and line.startswith("step 1 (epoch 0): the loss is nan") and "non-finite" in line, line
    assert not (work / "train" / "draft.safetensors").exists() and not (work / "train" / "state").exists()


# -- the three draft families on resume: a key the family does not read (``train.peagle.*`` for EAGLE-3,
# ``train.ttt_steps`` for P-EAGLE and DFlash: "ignored", the docs say) does not block a resume; a changed
# family does, naming ``train.family``.


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


def test_a_metrics_file_cut_back_on_resume_is_strict_json(tmp_path):
    """``truncate_jsonl`` (a resume cuts metrics.jsonl back to its step) wrote a NaN loss read from the
    file as ``NaN``, which jq and browsers refuse; now as null, and a line a strict reader takes."""
    from eaglenest.train.selection import read_jsonl, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN, "acc": [Infinity, 0.5]}\n{"step": 2, "loss": 1.0}\n')
    truncate_jsonl(path, 1)
    line = path.read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line!r}")) == \
        {"step": 1, "loss": None, "acc": [None, 0.5]}
    assert read_jsonl(path) == [{"step": 1, "loss": None, "acc": [None, 0.5]}]


def test_launch_of_a_unix_stream_on_several_ranks_is_refused_before_torchrun(tmp_path, capsys, monkeypatch):
    """`train launch --nproc 2 train.source=stream` started both ranks, each loading the target and the
    prompts and writing the output folder, before the stream refused a second rank."""
    from eaglenest.pipeline import train_cli

    started = []
    monkeypatch.setattr(train_cli, "wait_torchrun", lambda cmd: started.append(cmd) or 0)
    argv = ["launch", "--recipe", RECIPE, "--nproc", "2", "train.source=stream", f"run.workdir={tmp_path}"]
    assert train_cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train: error: train.stream.transport=unix: its one capture engine feeds one rank")
    assert "gives 2" in err[-1] and started == [] and not any(tmp_path.iterdir())
    assert train_cli.main(["launch", "--recipe", RECIPE, "--nproc", "1", "train.source=stream",
                           f"run.workdir={tmp_path}"]) == 0 and len(started) == 1


@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_rows_cut_before_every_loss_token_stop_before_saving(tmp_path, feature_store, tiny_target, family):
    """pack_tokens=8 with 8-token prompts cut every response away: each family "trained" 4 steps with loss 0.0
    on no position and saved the initial weights as its checkpoint and state."""
    work = tmp_path / "w"
    shallow = {"peagle": PEagleConfig(num_slots=3), "dflash": DFlashConfig(num_layers=1, block_size=3)}
    kw = {"family": family, "pack_tokens": 8, **({family: shallow[family]} if family in shallow else {})}
    with pytest.raises(StoreError) as e:
        run(work, feature_store, tiny_target, **kw)
    assert str(e.value).startswith("steps 1-2: no position to train on") and "train.pack_tokens=8" in str(e.value)
    assert "\n" not in str(e.value) and "oov_positions" not in str(e.value)
    assert not (work / "train" / "draft.safetensors").exists() and not (work / "train" / "state").exists()
    assert run(work, feature_store, tiny_target, **{**kw, "pack_tokens": 16}).final["step_count"][0] > 0
