"""The provenance file's command line: what a user would retype, with no machine's paths."""

from __future__ import annotations

import json
import subprocess
import sys

from eaglenest.provenance import command_line, write_provenance


def test_command_line_is_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert command_line([str(tmp_path / ".venv/bin/train"), "run", "--recipe", "r.yaml"]) == [
        ".venv/bin/train", "run", "--recipe", "r.yaml"]
    outside = str(tmp_path.parent / "elsewhere" / "tool")
    assert command_line([outside, "x"]) == [outside, "x"]  # not under it: left as it was
    assert command_line(["evaluate", "al"]) == ["evaluate", "al"]


def test_a_module_run_is_recorded_as_python_dash_m(tmp_path):
    """``python -m`` puts the module file's absolute path in sys.argv[0]; the record says the module."""
    code = ("import sys; from eaglenest.provenance import write_provenance; "
            "write_provenance(sys.argv[1], config={})")
    script = tmp_path / "mod_run.py"
    script.write_text(code)
    subprocess.run([sys.executable, "-m", "mod_run", str(tmp_path / "out"), "--flag"], cwd=tmp_path, check=True)
    argv = json.loads((tmp_path / "out" / "provenance.json").read_text())["argv"]
    assert argv == ["python", "-m", "mod_run", str(tmp_path / "out"), "--flag"]
    write_provenance(tmp_path / "given", config={}, argv=["a", "b"])
    assert json.loads((tmp_path / "given" / "provenance.json").read_text())["argv"] == ["a", "b"]
