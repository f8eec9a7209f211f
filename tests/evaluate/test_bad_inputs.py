"""Damaged drafts and reports at the ``evaluate`` edge: one line naming the file (and key), nothing
written, no traceback. No engine starts: every input here is refused before one would.

QA repros: ``evaluate offline --draft`` with an export whose config.json is garbage or whose
model.safetensors is truncated, or a checkpoint with truncated weights; ``evaluate compare`` with a
report whose fields have the wrong types, or ``--out`` under a file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.offline import load_draft


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize("file, damage, says", [
    ("config.json", lambda p: p.write_text("garbage{"), "config.json: not valid JSON"),
    ("config.json", lambda p: p.write_text("[1]"), "config.json: not a JSON object"),
    ("config.json", lambda p: p.write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]})),
     "config.json: not a draft config"),
    ("model.safetensors", _truncate, "model.safetensors: unreadable or not matching config.json"),
])
def test_offline_damaged_export(tmp_path, random_draft, tiny_target, file, damage, says):
    draft = tmp_path / "draft"
    shutil.copytree(random_draft, draft)
    damage(draft / file)
    with pytest.raises(ConfigError) as err:
        load_draft(draft, tiny_target)
    assert says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("digest", [True, False], ids=["digest", "before-digest"])
@pytest.mark.parametrize("damage", [_truncate, lambda p: p.write_bytes(b"")], ids=["truncated", "empty"])
def test_offline_damaged_checkpoint(tmp_path, toy_checkpoint, tiny_target, damage, digest):
    """A checkpoint with its weights digest is refused by ``read_info``; one from before it when loaded."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(toy_checkpoint, ckpt)
    info = ckpt / "checkpoint.json"
    if not digest:
        info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "weights_sha256"}))
    says = ("draft.safetensors: cannot read the draft weights" if digest
            else "draft.safetensors: unreadable or not matching checkpoint.json")
    damage(ckpt / "draft.safetensors")
    with pytest.raises(EaglenestError) as err:
        load_draft(ckpt, tiny_target)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_offline_refuses_a_damaged_draft_before_loading_the_target(tmp_path, toy_checkpoint, tiny_target,
                                                                   monkeypatch):
    import eaglenest.evaluate.offline as offline

    ckpt = tmp_path / "ckpt"
    shutil.copytree(toy_checkpoint, ckpt)
    _truncate(ckpt / "draft.safetensors")

    def target_loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the draft was checked")

    monkeypatch.setattr(offline, "load_target", target_loaded)
    with pytest.raises(EaglenestError, match="draft.safetensors: cannot read the draft weights"):
        offline.offline_al(target=tiny_target, draft=ckpt, groups={}, num_speculative_tokens=3, max_tokens=8)


@pytest.fixture
def report() -> dict:
    """The parts of an ``evaluate al`` report that ``compare`` reads."""
    row = {"prompts": 2, "acceptance_length": 2.5, "acceptance_length_per_request": 2.6}
    return {"draft": "d", "domains": {"code": dict(row)}, "overall": dict(row),
            "context_buckets": {"1024": dict(row)}}


@pytest.mark.parametrize("change, says", [
    (lambda r: r["overall"].update(acceptance_length="abc"), "overall.acceptance_length: not a number"),
    (lambda r: r.update(domains=[1, 2]), "domains: not an object of groups"),
    (lambda r: r.update(domains={"code": 3}), "domains.code: not an object"),
    (lambda r: r.update(context_buckets={"1024": {"acceptance_length_per_request": [1]}}),
     "context_buckets.1024.acceptance_length_per_request: not a number"),
])
def test_compare_report_field_types(capsys, tmp_path, root, report, change, says):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(report))
    change(report)
    bad.write_text(json.dumps(report))
    work = tmp_path / "work"
    code = evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                          "--a", str(good), "--b", str(bad)])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert f"{bad}: {says}" in lines[0], lines[0]
    assert not work.exists()


def test_compare_out_under_a_file_is_refused_first(capsys, tmp_path, root, monkeypatch):
    import eaglenest.evaluate.compare as compare_mod

    def never(*args, **kwargs):
        raise AssertionError("a draft was evaluated before --out was checked")

    monkeypatch.setattr(compare_mod, "evaluate_al", never)
    (tmp_path / "afile").write_text("x")
    draft = tmp_path / "draft"  # a draft folder: compare would evaluate it (start an engine) first
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    code = evaluate_main(["compare", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                          "--a", str(draft), "--b", str(draft), "--out", str(tmp_path / "afile" / "sub")])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evaluate: error: --out: cannot write to"), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "draft"]


def test_offline_names_the_flag_the_draft_came_from(tmp_path, random_draft, tiny_target):
    # `evaluate offline --draft D` on a damaged D said "evaluate.draft: ...", a key the user never set.
    import eaglenest.evaluate.offline as offline

    draft = tmp_path / "draft"
    shutil.copytree(random_draft, draft)
    (draft / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"^--draft: .*config.json: not a JSON object"):
        offline.offline_al(target=tiny_target, draft=draft, groups={}, num_speculative_tokens=3, max_tokens=8,
                           draft_key="--draft")


def test_parity_refuses_a_damaged_checkpoint_before_the_target_naming_its_flag(tmp_path, toy_checkpoint,
                                                                               tiny_target, monkeypatch):
    import eaglenest.evaluate.parity as parity

    ckpt = tmp_path / "ckpt"
    shutil.copytree(toy_checkpoint, ckpt)
    info = ckpt / "checkpoint.json"
    info.write_text(json.dumps({k: v for k, v in json.loads(info.read_text()).items() if k != "weights_sha256"}))
    _truncate(ckpt / "draft.safetensors")

    def target_loaded(*args, **kwargs):
        raise AssertionError("the target was loaded before the checkpoint was checked")

    monkeypatch.setattr(parity, "load_target", target_loaded)
    with pytest.raises(ConfigError, match=r"^--checkpoint: .*draft.safetensors: unreadable or not matching"):
        parity.parity_check(target=tiny_target, draft=tmp_path, checkpoint=ckpt, prompts={"a": [1, 2]}, k=2,
                            max_tokens=4, engine=None, min_identical=0.9, checkpoint_key="--checkpoint")


def test_evaluate_al_refuses_a_draft_vllm_would_fail_on_before_any_engine(tmp_path, toy_export, tiny_target,
                                                                          monkeypatch):
    # A d2t mapping past the target's vocabulary reached vLLM, which serves it until a request hits it.
    from safetensors.torch import load_file, save_file

    import eaglenest.evaluate.run as run
    from eaglenest.evaluate.config import EvaluateConfig

    draft = tmp_path / "draft"
    shutil.copytree(toy_export, draft)
    weights = load_file(str(draft / "model.safetensors"))
    weights["d2t"][-1] += 10**6
    save_file(weights, str(draft / "model.safetensors"))

    def engine(*args, **kwargs):
        raise AssertionError("an engine was started for a draft vLLM cannot serve")

    monkeypatch.setattr(run, "make_llm", engine)
    # the prompt plan (its own refusals come first, tests/evaluate/test_buckets_qa.py) is not under test here
    monkeypatch.setattr(run, "plan", lambda cfg, **kw: ({}, {}, None, 0, cfg.engine, None))
    with pytest.raises(ConfigError, match=r"model.safetensors: d2t maps draft id \d+ to target id \d+, outside the "
                                          r"target's vocabulary"):
        run.evaluate_al(target=str(tiny_target), draft=str(draft), store_uri=str(tmp_path / "none"),
                        cfg=EvaluateConfig())
