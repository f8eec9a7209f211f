"""The command line a provenance file records when a program runs a command with its own argv (QA pass 12).

A library caller, a notebook or a workflow engine runs ``main(["build", "--recipe", R, ...])`` in its own
process: the record said that process's ``sys.argv`` (pytest's, a Jupyter kernel's, the workflow's), not
the command that wrote the output. Now every command records the argv it ran with, under its program's
name; a command run from its own console script or ``python -m`` is recorded as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from eaglenest.cli import Command, run
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.provenance import command_line, write_provenance


def _body(recipe, args) -> int:
    write_provenance(args.out, config={})  # as ingest build and featurestore capture call it
    write_provenance(args.out + "-sys", config={}, argv=sys.argv)  # as the evaluate commands hand it over
    return 0


COMMANDS = {"go": Command(fn=_body, help="write two provenance files", needs_recipe=False,
                          args=[(("--out",), {"required": True}), (("--label",), {"default": ""})])}


def _argv(path) -> list[str]:
    return json.loads((path / "provenance.json").read_text())["argv"]


def test_a_command_run_with_its_own_argv_records_that_argv(tmp_path):
    out = tmp_path / "out dir"  # a blank in the path: one word of the record all the same
    assert run("mytool", "a test tool", COMMANDS, ["go", "--out", str(out), "--label", "a b"]) == 0
    ran = ["mytool", "go", "--out", str(out), "--label", "a b"]
    assert _argv(out) == ran
    assert _argv(tmp_path / "out dir-sys") == ran
    # once the command has ended, a plain write outside any command records the process's own argv again
    assert command_line() == command_line(list(sys.argv)) and command_line() != ran


def test_nested_commands_each_record_their_own_argv(tmp_path):
    def outer(recipe, args) -> int:
        run("inner", "the inner tool", COMMANDS, ["go", "--out", str(tmp_path / "inner")])
        write_provenance(args.out, config={})
        return 0

    commands = {"outer": Command(fn=outer, help="runs another command", needs_recipe=False,
                                 args=[(("--out",), {"required": True})])}
    assert run("outertool", "outer", commands, ["outer", "--out", str(tmp_path / "outer")]) == 0
    assert _argv(tmp_path / "inner") == ["inner", "go", "--out", str(tmp_path / "inner")]
    assert _argv(tmp_path / "outer") == ["outertool", "outer", "--out", str(tmp_path / "outer")]


def test_a_module_run_with_the_process_argv_is_still_python_dash_m(tmp_path):
    (tmp_path / "qa12_tool.py").write_text(textwrap.dedent("""
        import sys
        from eaglenest.cli import Command, run
        from eaglenest.provenance import write_provenance
        def body(recipe, args):
            write_provenance(args.out, config={})
            return 0
        sys.exit(run("qa12", "t", {"go": Command(fn=body, help="h", needs_recipe=False,
                                                 args=[(("--out",), {})])}))
    """))
    out = tmp_path / "o"
    subprocess.run([sys.executable, "-m", "qa12_tool", "go", "--out", str(out)], cwd=tmp_path, check=True,
                   timeout=120)
    assert _argv(out) == ["python", "-m", "qa12_tool", "go", "--out", str(out)]


def test_paths_in_a_library_callers_argv_are_its_words(root, tmp_path, capsys):
    """``main(["run", "--recipe", Path(...)])``: subprocess takes path objects in a command; the CLI raised
    TypeError ('PosixPath' object is not subscriptable) from inside argparse."""
    out = tmp_path / "out"
    assert run("mytool", "a test tool", COMMANDS, ["go", "--out", out]) == 0
    assert _argv(out) == ["mytool", "go", "--out", str(out)]
    assert train_main(["run", "--dry-run", "--recipe", root / "recipes" / "toy.yaml", "train.num_epochs=3"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["num_epochs"] == 3
