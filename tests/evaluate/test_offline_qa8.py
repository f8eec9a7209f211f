"""``evaluate offline`` of an exported draft honours ``run.target_keys`` (QA8).

A train checkpoint records where its training found the target's embeddings (``target_keys`` in
checkpoint.json, from ``run.target_keys`` or the rule); an export records none, and before the fix the
offline replay of an export ignored ``run.target_keys``: on a target whose layout the rule cannot tell
(two ``embed_tokens`` tensors) it stopped with "name it with run.target_keys.embed", even though it was
named. The target here is the tiny target with its language model under ``model.decoder.`` and a zeroed
decoy ``model.encoder.embed_tokens.weight`` beside it (transformers still loads it, the rule cannot tell).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglenest.errors import ConfigError
from eaglenest.evaluate.cli import main as evaluate_main
from eaglenest.evaluate.offline import load_draft

EMBED = "model.decoder.embed_tokens.weight"


@pytest.fixture(scope="module")
def nested_target(tmp_path_factory, tiny_target):
    dst = tmp_path_factory.mktemp("nested") / "nested target"
    shutil.copytree(tiny_target, dst)
    state = load_file(str(dst / "model.safetensors"))
    state[EMBED] = state.pop("model.embed_tokens.weight")
    state["model.encoder.embed_tokens.weight"] = torch.zeros_like(state[EMBED])
    state["model.decoder.norm.weight"] = state.pop("model.norm.weight")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_an_export_takes_the_embeddings_run_target_keys_names(nested_target, toy_export, tiny_target):
    with pytest.raises(ConfigError, match="run.target_keys.embed"):  # the rule alone cannot tell
        load_draft(toy_export, nested_target)
    draft = load_draft(toy_export, nested_target, target_keys={"embed": EMBED, "norm": "", "lm_head": ""})
    want = load_file(str(tiny_target / "model.safetensors"))["model.embed_tokens.weight"].float()
    assert torch.equal(draft.embed_tokens.weight, want)  # the named tensor, not the zeroed decoy


def test_evaluate_offline_of_an_export_reads_run_target_keys(capsys, tmp_path, root, nested_target, toy_export,
                                                            prompts_store):
    out = tmp_path / "out"
    rc = evaluate_main(["offline", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path / 'w'}",
                        f"run.target={nested_target}", f"run.store={prompts_store}", f"run.target_keys.embed={EMBED}",
                        "evaluate.chat_template_kwargs={}", "evaluate.max_tokens=4",
                        "evaluate.max_prompts_per_domain=1", "evaluate.num_speculative_tokens=1",
                        "--draft", str(toy_export), "--out", str(out)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    report = json.loads((out / "offline_report.json").read_text())
    assert report["overall"]["prompts"] == 2 and report["num_speculative_tokens"] == 1
