"""Export of a checkpoint whose record holds nulls where a value may be absent: ``train_config`` null
(every other reader of it takes null as absent), and a loss or vocabulary coverage that was NaN or
infinite, which checkpoint.json writes as null. The model card says n/a rather than stopping the
export with a traceback."""

from __future__ import annotations

import json
import shutil

from eaglenest.serve.export import export_draft
from eaglenest.train.checkpoint import INFO


def test_export_takes_a_null_train_config_as_absent(toy_checkpoint, tiny_target, tmp_path):
    ckpt = tmp_path / "train"
    shutil.copytree(toy_checkpoint, ckpt)
    info = json.loads((ckpt / INFO).read_text())
    info["train_config"] = None
    info["vocab_coverage"] = None  # a NaN written as null (provenance.write_json_atomic)
    info["metrics"] = {"loss": None, "step_acc": None}
    (ckpt / INFO).write_text(json.dumps(info))
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    card = (out / "README.md").read_text()
    assert "TTT steps None" in card
    assert "| last logged loss | n/a |" in card and "coverage of loss tokens: n/a" in card
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
