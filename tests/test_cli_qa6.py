"""QA pass 6 at the CLI edge: bad input a user types is one line naming the key or flag, exit 2, nothing
written. Each case failed before its fix (accepted, wrote into the current directory, or built a model
before refusing its folder)."""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path

import pytest

from eaglenest.errors import StoreError
from eaglenest.paths import check_output_dir, install_dir
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.tinytarget import archs, build, long


@pytest.mark.parametrize("value", ["", "  "])
def test_empty_run_target_is_refused_naming_the_key(tmp_path, capsys, monkeypatch, root, tiny_target, value):
    # Path("") is the current directory: run from inside a model folder, the run used it without a word.
    monkeypatch.chdir(tiny_target)
    work = tmp_path / "work"
    rc = train_main(["run", f"--recipe={root / 'recipes' / 'toy.yaml'}", "--dry-run", f"run.workdir={work}",
                     f"run.target={value}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, lines
    assert lines == ["train: error: run.target: must not be empty (a local Hugging Face model directory or a hub "
                     "id, e.g. assets/tiny-target)"]
    assert not work.exists()


def test_empty_prompts_out_is_refused_not_written_into_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `--prompts-out "$DIR"` with DIR unset
    with pytest.raises(SystemExit) as stopped:
        build.main(["--prompts-only", "--prompts-out", ""])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "eaglenest-tiny-target: error: argument --prompts-out: empty path", err
    assert list(tmp_path.iterdir()) == []


def test_empty_arch_out_dir_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(archs, "build", lambda arch, out: built.append(out) or out)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        archs.main(["qwen3", ""])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "python -m eaglenest.tinytarget.archs: error: argument OUT_DIR: empty path", err
    assert built == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--out", "--recipe", "--phase-dir"])
def test_an_empty_path_flag_of_the_long_builder_is_refused_naming_it(tmp_path, capsys, monkeypatch, flag):
    # --recipe "" was taken as no recipe (a default build started); --out "" and --phase-dir "" were the
    # current directory.
    monkeypatch.chdir(tmp_path)
    argv = ["--out", str(tmp_path / "long"), "--stages", "128x1x1:repeat64", "--eval-buckets", "1024"]
    with pytest.raises(SystemExit) as stopped:
        long.main([*argv, flag, ""])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"python -m eaglenest.tinytarget.long: error: argument {flag}: empty path", err
    assert list(tmp_path.iterdir()) == []


def _bench(name: str):
    bench = Path(__file__).resolve().parents[1] / "bench"
    spec = importlib.util.spec_from_file_location(f"_bench_qa6_{name[:-3]}", bench / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["serve_throughput.py", "serve_fp8.py"])
def test_an_empty_bench_out_is_refused_not_the_current_directory(tmp_path, capsys, monkeypatch, name):
    # --out "" wrote the results (and serve_fp8's three exports) into the current directory.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        _bench(name).main(["--out", ""])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: argument --out: empty path")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out", [".", "..", "/"])
def test_an_output_folder_that_is_the_current_a_parent_or_the_root_is_refused(tmp_path, monkeypatch, out):
    """`python -m eaglenest.tinytarget.archs qwen3 .` in an empty folder built the model, then failed to
    rename the folder it runs in ("Device or resource busy"), leaving an empty side folder behind."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match=rf"^--out: .* names no folder of its own; give a new folder"):
        check_output_dir(out, "--out", replaces=lambda p: True)


def test_an_output_folder_that_cannot_be_moved_aside_leaves_no_side_folder(tmp_path, monkeypatch):
    """install_dir moves an earlier output aside before the new one goes in; when that rename fails
    (a mount point, a busy folder) the empty side folder it made for it was left behind."""
    out, tmp = tmp_path / "out", tmp_path / "new"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    real = os.replace

    def busy(src, dst):
        if Path(src) == out:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", busy)
    with pytest.raises(OSError):
        install_dir(tmp, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]
    assert (out / "old.txt").read_text() == "old"
