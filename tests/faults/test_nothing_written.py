"""A refused command writes nothing; an output folder that cannot be made is one line (issue 23).

Every CLI used to write ``<workdir>/logs/vllm-logging.json`` as it started, so a bad manifest, a
bad override or a refused query still left a folder in the user's workdir; the conftest's
``VLLM_LOGGING_LEVEL`` (a user's own vLLM setting, which switches that file off) hid it from the
rest of the suite. Here each CLI runs in-process with the environment a user's shell has: no
``VLLM_LOGGING_*``. ``train run`` with a workdir it cannot write used to end in a traceback at the
output folder's ``mkdir`` (exit 1); now it is refused before the store is read, in one line.
"""

from __future__ import annotations

import os
import stat

import pytest

from eaglenest import engine
from eaglenest.engine import VLLM_LOG_ENV
from eaglenest.errors import StoreError
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.paths import ensure_writable, make_dir
from eaglenest.pipeline.train_cli import main as train_main
from eaglenest.serve.cli import main as serve_main

MANIFEST = """\
name: t
licence: CC0-1.0
generation:
  max_tokens: 4
  reasoning: "on"
domains:
  math:
    cap_prompts: 10
    sources:
      - path: {src}
        provenance: test
"""


@pytest.fixture
def user_env(monkeypatch):
    """No VLLM_LOGGING_* and no deferred log folder, as in a user's shell; restored afterwards."""
    for k in VLLM_LOG_ENV:
        monkeypatch.setenv(k, "x")  # recorded first, so the teardown puts back what was there
        monkeypatch.delenv(k)
    monkeypatch.setattr(engine, "_deferred_log_dir", None)  # this process's deferred folder, restored after


def _one_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: ") and len(lines[0]) < 500, err[-2000:]
    return lines[0]


def _manifest(tmp_path, name: str, text: str | None = None):
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    m = tmp_path / name
    m.write_text(text if text is not None else MANIFEST.format(src=src))
    return m


def _refusals(tmp_path, root, tiny_target):
    """(name, CLI main, argv without run.workdir, what the line says): each refused on a fresh workdir."""
    common = [f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.target={tiny_target}"]
    return {
        "bad manifest": (ingest_main, ["build", f"--manifest={_manifest(tmp_path, 'bad.yaml', 'name: [')}", *common],
                         "not valid YAML"),
        "bad override": (ingest_main, ["build", f"--manifest={_manifest(tmp_path, 'm.yaml')}", *common,
                                       "ingest.chat_template_kwargs={enable_thinking: false}"],
                         "ingest.chat_template_kwargs: enable_thinking=False contradicts"),
        "refused query": (featurestore_main, ["query", "--sql", "DELETE FROM features", *common],
                          "only SELECT/WITH statements"),
        "capture before ingest": (featurestore_main, ["capture", *common], "no prompts table"),
        "train before capture": (train_main, ["run", *common], "no table 'features'"),
        "export before train": (serve_main, ["export", *common], "no checkpoint.json"),
        "evaluate before export": (evaluate_main, ["al", *common], "no exported draft"),
    }


@pytest.mark.parametrize("case", ["bad manifest", "bad override", "refused query", "capture before ingest",
                                  "train before capture", "export before train", "evaluate before export"])
def test_a_refused_command_leaves_the_workdir_unwritten(tmp_path, root, tiny_target, capsys, user_env, case):
    main, argv, says = _refusals(tmp_path, root, tiny_target)[case]
    work = tmp_path / "work"
    assert main([*argv, f"run.workdir={work}"]) == 2
    line = _one_line(capsys, main.__module__.split(".")[1].replace("pipeline", "train"))
    assert says in line, line
    assert not work.exists(), sorted(str(p.relative_to(work)) for p in work.rglob("*"))  # nor its store


# -- output folders that cannot be made ---------------------------------------------------------------
def _unwritable(tmp_path, how: str):
    """A workdir this process cannot write, really refused by the OS (no mock)."""
    if how == "read-only folder":
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return ro / "work", "Permission denied"
    if how == "under a regular file":
        blocker = tmp_path / "blocker"
        blocker.write_text("a file where a directory is expected\n")
        return blocker / "work", "Not a directory"
    return "/proc/eaglenest-no-such-dir/work", "No such file or directory"  # nobody creates folders in /proc


@pytest.mark.parametrize("how", [
    pytest.param("read-only folder", marks=pytest.mark.skipif(
        os.geteuid() == 0, reason="root writes through chmod; the two other cases fail for root too")),
    "under a regular file", "under /proc"])
def test_train_run_with_an_unwritable_workdir_is_one_line(tmp_path, root, tiny_target, capsys, user_env, how):
    work, reason = _unwritable(tmp_path, how)
    store = tmp_path / "store"  # not there either: the workdir is refused before the store is read
    try:
        code = train_main(["run", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                           f"run.store={store}", f"run.target={tiny_target}"])
    finally:
        if how == "read-only folder":
            (tmp_path / "ro").chmod(stat.S_IRWXU)
    assert code == 2
    line = _one_line(capsys, "train")
    assert line.startswith("train: error: run.workdir: cannot write to ") and line.endswith(f"work/train ({reason})")
    assert not store.exists()


def test_make_dir_and_the_check_turn_os_refusals_into_one_line(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(StoreError, match=r"^train\.output_subdir: cannot write to .*/blocker/a/b \(Not a directory\)$"):
        make_dir(blocker / "a" / "b", "train.output_subdir")
    with pytest.raises(StoreError, match=r"^run\.workdir: .*/blocker is a file, not a directory$"):
        make_dir(blocker, "run.workdir")
    # A check made before the input is all accepted leaves nothing behind, whatever it created.
    ensure_writable(tmp_path / "x" / "y" / "z", "run.workdir", keep=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]
    ensure_writable(tmp_path / "x" / "y", "run.workdir")
    assert (tmp_path / "x" / "y").is_dir() and not any((tmp_path / "x" / "y").iterdir())


def test_serve_export_into_an_unwritable_folder_is_one_line(tmp_path, root, tiny_target, capsys, user_env):
    work, reason = _unwritable(tmp_path, "under a regular file")
    assert serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={tiny_target}"]) == 2
    line = _one_line(capsys, "serve")
    assert line.startswith("serve: error: run.workdir: cannot write to ") and line.endswith(f"/work ({reason})")
