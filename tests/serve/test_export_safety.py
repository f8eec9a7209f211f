"""``serve export`` replaces only an earlier export, never a folder a user made, and refuses a
damaged checkpoint in one line (exit 2) having written nothing. No engine starts.

Each case is a QA repro: before its fix export deleted the folder it wrote to (the whole workdir
with ``serve.draft_subdir=.``, unrelated data under ``--out``, the checkpoint it had just read),
or printed a traceback for a truncated, missing or mismatched checkpoint.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
from safetensors.torch import load_file, save_file

from eaglenest.errors import StoreError
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.export import export_draft, is_export


def _one_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in lines if " WARNING " not in x and " INFO " not in x]  # log lines
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def work(tmp_path, toy_checkpoint) -> Path:
    """A workdir holding a checkpoint of the tiny target, a store folder and an eval report."""
    w = tmp_path / "work"
    (w / "train").mkdir(parents=True)
    for name in ("checkpoint.json", "draft.safetensors"):
        shutil.copy(toy_checkpoint / name, w / "train" / name)
    (w / "store").mkdir()
    (w / "store" / "table.lance").write_text("rows")
    (w / "eval").mkdir()
    (w / "eval" / "report.json").write_text("{}")
    return w


def _export(root, tiny_target, work, *extra) -> int:
    return serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}", *extra])


@pytest.mark.parametrize("extra, says", [
    (["serve.draft_subdir=."], "serve.draft_subdir: a folder inside run.workdir, not run.workdir itself"),
    (["serve.draft_subdir=./"], "serve.draft_subdir: a folder inside run.workdir, not run.workdir itself"),
    (["serve.draft_subdir=train"], "serve.draft_subdir: 'train' would overwrite the checkpoint"),
    (["serve.draft_subdir=train/sub"], "would overwrite the checkpoint"),
    (["serve.draft_subdir=store"], "would overwrite the feature store"),
    (["serve.draft_subdir=eval"], "holds files that are not an exported draft"),
    (["--out", "{work}"], "--out: {work} would overwrite the checkpoint"),
    (["--out", "{work}/train"], "--out: {work}/train would overwrite the checkpoint"),
    (["--out", "{work}/eval/report.json"], "--out: {work}/eval/report.json is a file, not a directory"),
])
def test_export_never_replaces_what_is_not_an_export(capsys, root, tiny_target, work, extra, says):
    before = _snapshot(work)
    extra = [x.format(work=work) for x in extra]
    assert _export(root, tiny_target, work, *extra) == 2
    line = _one_line(capsys)
    assert line.startswith("serve: error: ") and says.format(work=work) in line, line
    assert _snapshot(work) == before
    assert sorted(p.name for p in work.iterdir()) == ["eval", "store", "train"]  # no tmp folder left


def test_out_with_user_files_is_refused_and_kept(capsys, root, tiny_target, work, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert _export(root, tiny_target, work, "--out", str(mine)) == 2
    assert _one_line(capsys) == (f"serve: error: --out: {mine} holds files that are not an exported draft; "
                                 "choose an empty or new folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "work"]
    assert (mine / "notes.txt").read_text() == "keep me"


def test_reexport_replaces_an_earlier_export(root, tiny_target, work, tmp_path):
    assert _export(root, tiny_target, work) == 0
    draft = work / "draft"
    assert is_export(draft)
    assert json.loads((draft / "provenance.json").read_text())["stage"] == "serve export"
    (draft / "config.json").write_text(json.dumps({**json.loads((draft / "config.json").read_text()), "old": 1}))
    # An export made before the stage marker is recognised by its shape.
    prov = json.loads((draft / "provenance.json").read_text())
    del prov["stage"]
    (draft / "provenance.json").write_text(json.dumps(prov))
    assert is_export(draft)
    assert _export(root, tiny_target, work) == 0
    assert "old" not in json.loads((draft / "config.json").read_text())
    assert sorted(p.name for p in work.iterdir()) == ["draft", "eval", "store", "train"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _export(root, tiny_target, work, "--out", str(empty)) == 0 and is_export(empty)


def test_failed_write_keeps_the_earlier_export(root, tiny_target, work, monkeypatch):
    assert _export(root, tiny_target, work) == 0
    before = _snapshot(work / "draft")

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(StoreError, match="cannot write .*No space left on device"):
        export_draft(work / "train", work / "draft", target_dir=tiny_target)
    assert _snapshot(work / "draft") == before
    assert sorted(p.name for p in work.iterdir()) == ["draft", "eval", "store", "train"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_exports_side_folders_are_swept(root, tiny_target, work):
    """An export killed while writing (``.draft.tmp-PID-*``) or after moving the earlier export aside
    (``.draft.old-PID-*``) leaves its side folder; the next export removes it once PID is gone, and
    never touches the side folder of an export still running."""
    assert _export(root, tiny_target, work) == 0
    dead = _dead_pid()
    half = work / f".draft.tmp-{dead}-x1"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    shutil.copytree(work / "draft", work / f".draft.old-{dead}-x2")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as live:
        running = work / f".draft.tmp-{live.pid}-x3"
        running.mkdir()
        try:
            assert _export(root, tiny_target, work) == 0
            assert sorted(p.name for p in work.iterdir()) == [running.name, "draft", "eval", "store", "train"]
        finally:
            live.kill()
    assert is_export(work / "draft")


def test_an_export_killed_between_its_renames_is_put_back(root, tiny_target, work):
    """Killed after moving the earlier export aside and before renaming the new one in: the folder is
    missing; the next export puts the earlier one back before it replaces it, and sweeps the rest."""
    assert _export(root, tiny_target, work) == 0
    dead = _dead_pid()
    before = _snapshot(work / "draft")
    (work / "draft").rename(work / f".draft.old-{dead}-a")
    shutil.copytree(work / f".draft.old-{dead}-a", work / f".draft.tmp-{dead}-b")
    from eaglenest.serve.export import sweep_leftovers

    assert sweep_leftovers(work / "draft") == [work / f".draft.tmp-{dead}-b"]
    assert _snapshot(work / "draft") == before
    assert sorted(p.name for p in work.iterdir()) == ["draft", "eval", "store", "train"]


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _mix_runs(p: Path) -> None:
    """Weights of a run with a 512-token draft vocab beside a checkpoint.json that says 1024."""
    state = load_file(str(p))
    state["lm_head.weight"] = state["lm_head.weight"][:512].contiguous()
    save_file(state, str(p))


#: (damage, what the line says for a checkpoint with its weights digest, for one from before it)
DAMAGE = [
    (_truncate, "train/draft.safetensors: cannot read the draft weights", "train/draft.safetensors: unreadable"),
    (lambda p: p.write_bytes(b""), "train/draft.safetensors: cannot read the draft weights",
     "train/draft.safetensors: unreadable"),
    (lambda p: p.unlink(), "train/draft.safetensors: cannot read the draft weights",
     "train/draft.safetensors: missing"),
    (_mix_runs, "train/draft.safetensors: these weights are not the ones checkpoint.json describes",
     "train/draft.safetensors: tensor lm_head.weight is [512, 128], checkpoint.json's config makes it [1024, 128]"),
    (lambda p: (p.parent / "checkpoint.json").write_text(json.dumps(
        {k: v for k, v in json.loads((p.parent / "checkpoint.json").read_text()).items() if k != "draft_config"})),
     "train/checkpoint.json: no draft_config", "train/checkpoint.json: no draft_config"),
]


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "before-digest"])
@pytest.mark.parametrize("damage, says, says_old", DAMAGE,
                         ids=["truncated", "empty", "missing", "mixed-runs", "no-draft-config"])
def test_damaged_checkpoint_is_one_line(capsys, root, tiny_target, work, damage, says, says_old, digest):
    """Checkpoints carry a digest tying the weights to checkpoint.json (``train/checkpoint.py``);
    one written before it is checked tensor by tensor against its config."""
    info = work / "train" / "checkpoint.json"
    if not digest:
        info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "weights_sha256"}))
    damage(work / "train" / "draft.safetensors")
    assert _export(root, tiny_target, work) == 2
    line = _one_line(capsys)
    assert (says if digest else says_old) in line, line
    assert sorted(p.name for p in work.iterdir()) == ["eval", "store", "train"]
