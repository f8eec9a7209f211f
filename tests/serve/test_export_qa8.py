"""``serve export`` for a target whose tokenizer or chat template is not the one the draft was trained
with (QA8). The checkpoint records its features' identity (tokenizer and chat-template sha256); before
the fix a copy of the target with an edited template or another tokenizer exported without a word, and
vLLM served the draft on token ids it never saw. No engine starts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglenest.featurestore.capture.identity import tokenizer_hashes
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.export import is_export


def _one_line(capsys) -> str:
    lines = [x for x in capsys.readouterr().err.strip().splitlines() if " WARNING " not in x and " INFO " not in x]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _workdir(w: Path, toy_checkpoint, captured, stamp) -> Path:
    """``w`` holding a checkpoint of the tiny target whose features' identity is ``captured``'s."""
    (w / "train").mkdir(parents=True)
    for name in ("checkpoint.json", "draft.safetensors"):
        shutil.copy(toy_checkpoint / name, w / "train" / name)
    stamp(w / "train", captured)
    return w


@pytest.fixture
def work(tmp_path, toy_checkpoint, tiny_target, stamp_identity) -> Path:
    return _workdir(tmp_path / "work dir ü", toy_checkpoint, tiny_target, stamp_identity)


def _export(root, target, work, *extra) -> int:
    return serve_main(["export", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={work}",
                       f"run.target={target}", *extra])


def test_an_edited_chat_template_is_refused_naming_both_hashes(capsys, root, work, tiny_target, edited_target):
    assert _export(root, edited_target, work) == 2
    line = _one_line(capsys)
    tok_then, tpl_then = tokenizer_hashes(str(tiny_target))
    tok_now, tpl_now = tokenizer_hashes(str(edited_target))
    assert f"chat template (sha256 {tpl_then[:12]} in the feature identity of {work}/train/checkpoint.json, " \
           f"{tpl_now[:12]} in {edited_target})" in line, line
    assert f"differ from those of {tiny_target}" in line and "run.off_policy=true" in line, line
    assert not (work / "draft").exists()  # nothing written


def test_another_tokenizer_is_refused_and_the_template_not_named(capsys, tmp_path, root, work, tiny_target):
    other = tmp_path / "other tokenizer"
    shutil.copytree(tiny_target, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps(tok, indent=1, sort_keys=True) + "\n")  # another file
    assert _export(root, other, work) == 2
    line = _one_line(capsys)
    tok_then, tok_now = tokenizer_hashes(str(tiny_target))[0], tokenizer_hashes(str(other))[0]
    assert f"run.target: the tokenizer files (sha256 {tok_then[:12]} in the feature identity of " in line, line
    assert f", {tok_now[:12]} in {other}) differ from those of {tiny_target}" in line, line
    assert "chat template" not in line.split("differ from")[0], line
    assert not (work / "draft").exists()


def test_off_policy_exports_with_a_warning_and_the_same_target_exports(caplog, capsys, root, work, tiny_target,
                                                                        edited_target):
    assert _export(root, edited_target, work, "run.off_policy=true") == 0
    assert is_export(work / "draft")
    assert any("chat template" in r.getMessage() and "run.off_policy=true" in r.getMessage() for r in caplog.records)
    shutil.rmtree(work / "draft")
    assert _export(root, tiny_target, work) == 0 and is_export(work / "draft")  # its own target: no refusal


def test_a_template_given_to_a_base_model_since_is_not_refused(capsys, tmp_path, root, toy_checkpoint, tiny_target,
                                                                stamp_identity):
    """A base model's draft (no chat template when its features were captured: no chat in them) exports for
    the same target with a template added since; another tokenizer is still refused."""
    base = tmp_path / "base"
    shutil.copytree(tiny_target, base)
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    (base / "tokenizer_config.json").write_text(json.dumps(cfg))
    work = _workdir(tmp_path / "w", toy_checkpoint, base, stamp_identity)
    (base / "chat_template.jinja").write_text(template)  # the template given since, beside the tokenizer
    assert _export(root, base, work) == 0 and is_export(work / "draft")
    (base / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 7}))
    assert _export(root, base, work) == 2
    assert "run.target: the tokenizer files (sha256 " in _one_line(capsys)
