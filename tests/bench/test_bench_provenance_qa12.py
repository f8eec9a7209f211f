"""The benches that had no provenance beside their outputs, and learning-curve folders shared by recipes
(QA pass 12).

- ``bench/learning_curves.py`` and ``bench/families.py`` named a point's folders by variant and epochs only
  (``lc_train_default_e2``): a run of another recipe (or the same variant name with other overrides) trained
  into the same folder, so the drafts and reports kept for re-evaluation were the last recipe's, whatever the
  rows said. Now the folder names end in a hash of the recipe and the overrides, and a variant's name cannot
  leave the workdir (``../x``).
- ``learning_curves.jsonl``, ``families.jsonl`` and ``serve_fp8.py``'s ``results.json`` had no provenance file
  (STYLE.md 12: one beside every output).

``_run`` (the bench's ``train run`` / ``serve export`` / ``evaluate al`` subprocess) is replaced by one that
writes what those commands write and the bench reads; serve_fp8 runs for real on the tiny target.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest
from bench_helpers import load_bench  # tests/bench on sys.path via conftest

from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store


def load(name: str):
    return load_bench(name, "_bench_qa12")


@pytest.fixture
def curves(monkeypatch):
    mod = load("learning_curves.py")
    ran: list[list[str]] = []

    def fake_run(cmd: list[str], log: Path) -> float:
        ran.append(cmd)
        over = dict(a.split("=", 1) for a in cmd if "=" in a and not a.startswith("-"))
        work = Path(over["run.workdir"])
        if cmd[1] == "run":  # train run: its checkpoint.json
            (work / over["train.output_subdir"]).mkdir(parents=True)
            (work / over["train.output_subdir"] / "checkpoint.json").write_text(json.dumps({"step": 3}))
        elif cmd[1] == "al":  # evaluate al: its report.json
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "report.json").write_text(json.dumps({"overall": {
                "acceptance_length": 1.5, "acceptance_by_position": [0.5], "prompts": 2, "ngram_al": None}}))
        return 1.0

    monkeypatch.setattr(mod, "_run", fake_run)
    mod.ran = ran
    return mod


def _outputs(cmds: list[list[str]]) -> set[str]:
    return {a.split("=", 1)[1] for cmd in cmds for a in cmd
            if a.startswith(("train.output_subdir=", "serve.draft_subdir=", "evaluate.draft="))} | {
        cmd[cmd.index("--out") + 1] for cmd in cmds if "--out" in cmd}


def test_two_recipes_measure_into_their_own_folders(curves, root, tmp_path):
    other = tmp_path / "other.yaml"
    shutil.copy(root / "recipes" / "toy.yaml", other)
    toy = str(root / "recipes" / "toy.yaml")
    curves.measure(toy, tmp_path, "default", [], 2, tmp_path / "log.txt")
    first = _outputs(curves.ran)
    curves.ran.clear()
    curves.measure(str(other), tmp_path, "default", [], 2, tmp_path / "log.txt")
    assert not first & _outputs(curves.ran), (first, _outputs(curves.ran))
    curves.ran.clear()  # the same name given other overrides: its own folders too
    curves.measure(toy, tmp_path, "default", ["train.lr=0.1"], 2, tmp_path / "log.txt")
    assert not first & _outputs(curves.ran)


def test_the_same_point_names_the_same_folders(curves, root, tmp_path):
    toy = str(root / "recipes" / "toy.yaml")
    again = str(root / "recipes" / ".." / "recipes" / "toy.yaml")
    assert curves.point_dirs(tmp_path, toy, "default", [], 4) == curves.point_dirs(tmp_path, again, "default", [], 4)
    assert curves.point_dirs(tmp_path, toy, "default", [], 4) != curves.point_dirs(tmp_path, toy, "default", [], 2)


@pytest.mark.parametrize("name", ["../escape", "a/b", "x y", ".hidden", "lm_head+norm"])
def test_a_variant_name_stays_one_folder_inside_the_workdir(curves, root, tmp_path, name):
    work = tmp_path / "work"
    for path in curves.point_dirs(work, str(root / "recipes" / "toy.yaml"), name, [], 2).values():
        assert path.parent in (work, work / "lc") and not path.name.startswith("."), path


def test_learning_curves_writes_provenance_beside_its_results(curves, root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # run from elsewhere: the recipe is read from the checkout, as its commands run there
    argv = ["learning_curves.py", "--workdir", str(tmp_path), "--epochs", "2", "--variant", "lr=train.lr=0.1"]
    monkeypatch.setattr(sys, "argv", argv)
    assert curves.main() == 0
    capsys.readouterr()
    record = json.loads((tmp_path / "learning_curves.provenance.json").read_text())
    assert record["config"]["recipe"]["train"]["num_epochs"] == 10  # toy.yaml's, resolved
    assert record["config"]["bench"] == {"variants": [["lr", ["train.lr=0.1"]]], "epochs": [2]}
    assert record["outputs"] == {"results": "learning_curves.jsonl"} and record["argv"][1:] == argv[1:]
    assert record["inputs"]["recipe"] == "recipes/toy.yaml" and record["code_version"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_families_sweeps_of_two_recipes_keep_their_own_folders(monkeypatch, root, tmp_path):
    monkeypatch.setitem(sys.modules, "learning_curves", load("learning_curves.py"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    fam = load("families.py")
    args = SimpleNamespace(recipe=str(root / "recipes" / "toy.yaml"), ngram_order=3, extra=[])
    other = SimpleNamespace(**{**vars(args), "recipe": str(tmp_path / "other.yaml")})
    assert fam.fam_dir(args, tmp_path, "sweep", "eagle3", 2, 4) != fam.fam_dir(other, tmp_path, "sweep", "eagle3", 2, 4)
    assert fam.curve_dirs(args, tmp_path, "eagle3", 2) != fam.curve_dirs(other, tmp_path, "eagle3", 2)
    more = SimpleNamespace(**{**vars(args), "extra": ["train.lr=0.1"]})
    assert fam.fam_dir(args, tmp_path, "tput", "eagle3", 2, 3) != fam.fam_dir(more, tmp_path, "tput", "eagle3", 2, 3)


def _prompt(sid: str, split: str, text: str) -> dict:
    return dict(sample_id=sid, domain="arithmetic", source="test", split=split, mode="chat",
                messages_json=json.dumps([{"role": "user", "content": text}]), prompt_token_ids=[],
                response_token_ids=[], finish_reason="", gen_params_id="g")


def test_serve_fp8_writes_provenance_beside_its_results(toy_checkpoint, tiny_target, tmp_path, capsys):
    work = tmp_path / "run dir"
    shutil.copytree(toy_checkpoint, work / "train")
    rows = [_prompt("h-0", "heldout", "What is 2 + 2?"), _prompt("t-0", "train", "What is 5 + 5?")]
    store.append(str(work / "store"), store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    out = tmp_path / "out"
    argv = ["--workdir", str(work), "--target", str(tiny_target), "--out", str(out), "--max-tokens", "4"]
    assert load("serve_fp8.py").main(argv) == 0
    capsys.readouterr()
    record = json.loads((out / "provenance.json").read_text())
    assert (out / "results.json").is_file() and record["argv"] == ["bench/serve_fp8.py", *argv]
    assert record["inputs"]["checkpoint"] == str(work / "train") and record["inputs"]["prompts"] == 1
    assert record["config"]["bench"]["max_tokens"] == 4 and record["config"]["bench"]["out"] == str(out)
    assert record["outputs"] == {"results": "results.json", "drafts": ["bf16", "fp8", "native"]}
