"""Inputs that used to end in a traceback or a multi-line error: an output name as long as the file
system allows (the side file written beside it is longer), a workdir under a regular file for a
command that starts a server, and an error that echoes a path holding a newline. Each is now one
line on stderr and exit 2 (or, for a name that fits, the output written)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eaglenest import cli
from eaglenest.errors import ConfigError, StoreError
from eaglenest.serve.export import export_draft


def test_export_out_name_too_long_for_its_side_folder(tmp_path, toy_checkpoint, tiny_target):
    out = tmp_path / ("d" * 250)
    with pytest.raises(ConfigError, match=r"--out: .*: cannot write beside it \(File name too long\)") as info:
        export_draft(toy_checkpoint, out, target_dir=tiny_target)
    assert "\n" not in str(info.value) and not out.exists()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)


def test_serve_up_with_a_workdir_under_a_file(tmp_path, tiny_target):
    (tmp_path / "file").write_text("x")
    proc = _cli("eaglenest.serve.cli", "up", "--no-spec", f"run.workdir={tmp_path / 'file' / 'w'}",
                f"run.target={tiny_target}", "serve.port=0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("serve: error: run.workdir: ") and "serve" in lines[-1], lines


def _fails_with_newline(recipe, args):
    raise StoreError("a value a user gave\nwith a newline in it")


def test_an_error_echoing_a_newline_stays_one_line(capsys):
    """Every CLI prints an error as one line whatever its message echoes (a path, a name, a value):
    a newline or another control character comes out escaped."""
    code = cli.run("demo", "d", {"fail": cli.Command(_fails_with_newline, "fails", needs_recipe=False)}, ["fail"])
    err = capsys.readouterr().err
    assert code == 2 and err == "demo: error: a value a user gave\\nwith a newline in it\n", err
