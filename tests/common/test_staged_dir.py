"""``paths.staged_dir``: an output folder written whole or not at all (the tiny-target builders)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from eaglenest.errors import ConfigError
from eaglenest.paths import check_output_dir, staged_dir


def _is_model(p):
    return (p / "config.json").is_file()


def _model(path, text):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(text)
    return path


def test_a_failed_block_leaves_the_earlier_output_as_it_was(tmp_path):
    out = _model(tmp_path / "m", "old")
    with pytest.raises(RuntimeError):
        with staged_dir(out, "--out", replaces=_is_model, error=ConfigError) as tmp:
            (tmp / "config.json").write_text("half")
            raise RuntimeError("killed mid-way")
    assert (out / "config.json").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["m"]


def test_a_finished_block_replaces_the_earlier_output_whole(tmp_path):
    out = _model(tmp_path / "m", "old")
    (out / "stale.bin").write_text("from the old build")
    with staged_dir(out, "--out", replaces=_is_model, error=ConfigError) as tmp:
        assert tmp.parent == tmp_path and not (tmp / "config.json").exists()
        (tmp / "config.json").write_text("new")
    assert sorted(os.listdir(out)) == ["config.json"] and (out / "config.json").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_a_new_output_and_an_empty_folder_are_created(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "a" / "b", tmp_path / "empty"):
        with staged_dir(out, "--out", replaces=_is_model, error=ConfigError) as tmp:
            (tmp / "config.json").write_text("x")
        assert (out / "config.json").read_text() == "x"


@pytest.mark.parametrize("make, says", [
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")), "is a folder of other files"),
    (lambda p: p.write_text("a file"), "is a file; give a folder"),
])
def test_what_is_not_an_earlier_output_is_refused_and_kept(tmp_path, make, says):
    out = tmp_path / "m"
    make(out)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ConfigError, match=rf"^--out: .*m {says}"):
        check_output_dir(out, "--out", replaces=_is_model, error=ConfigError)
    with pytest.raises(ConfigError, match=says):
        with staged_dir(out, "--out", replaces=_is_model, error=ConfigError):
            raise AssertionError("the block ran")
    assert sorted(os.listdir(tmp_path)) == before


def test_an_unwritable_place_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^--out: .*file.* is a file, not a directory"):
        check_output_dir(blocker / "m", "--out", replaces=_is_model, error=ConfigError)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_side_folders_of_a_killed_writer_are_swept_and_a_moved_output_put_back(tmp_path):
    # Killed between its two renames: the earlier output is aside (.m.old-<pid>-*), `m` missing.
    pid = _dead_pid()
    _model(tmp_path / f".m.old-{pid}-abc", "old")
    _model(tmp_path / f".m.tmp-{pid}-def", "half")
    out = tmp_path / "m"
    with pytest.raises(RuntimeError):
        with staged_dir(out, "--out", replaces=_is_model, error=ConfigError):
            assert (out / "config.json").read_text() == "old"  # put back before the new build starts
            raise RuntimeError("stop")
    assert sorted(os.listdir(tmp_path)) == ["m"] and (out / "config.json").read_text() == "old"


def test_the_output_folder_gets_mkdirs_mode_not_owner_only(tmp_path):
    with staged_dir(tmp_path / "m", "--out", replaces=_is_model, error=ConfigError) as tmp:
        (tmp / "config.json").write_text("x")
    (tmp_path / "plain").mkdir()
    assert (tmp_path / "m").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
