"""QA 11: a draft whose vocabulary is the target's whole vocabulary (``train.draft_vocab_size`` = the
target's ``vocab_size``, the largest value the recipe takes) exports to a folder vLLM loads, in every
family. vLLM 0.32's draft models (``llama_eagle3``, ``qwen3_dflash``) have no ``draft_id_to_target_id``
parameter when the two vocabularies are equal, and refused the export's ``d2t`` at engine start
("There is no module or parameter named 'draft_id_to_target_id'")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eaglenest.serve.draft_files import check_draft_dir
from eaglenest.serve.export import export_draft
from eaglenest.train.checkpoint import save_checkpoint
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig
from eaglenest.train.loop import build_draft
from eaglenest.train.target import load_target_tensors
from eaglenest.train.vocab import select_vocab

LAYER_IDS = (2, 4, 5)


def full_vocab_checkpoint(family: str, target: Path, out: Path) -> Path:
    """An untrained checkpoint of ``family`` whose draft vocabulary is the target's whole vocabulary."""
    t = load_target_tensors(target)
    vocab_size = int(t["config"]["vocab_size"])
    cfg = TrainConfig(family=family, draft_vocab_size=vocab_size, ttt_steps=2, peagle=PEagleConfig(num_slots=2),
                      dflash=DFlashConfig(num_layers=1, block_size=3))
    vocab = select_vocab(torch.randint(0, 100, (vocab_size,), generator=torch.Generator().manual_seed(0)).numpy(),
                         vocab_size)
    model = build_draft(cfg, t, layer_ids=LAYER_IDS, vocab=vocab, seed=0)
    assert model.d2t.eq(0).all()  # every id its own
    return save_checkpoint(out, model, info={"layer_ids": list(LAYER_IDS), "step": 0, "table_version": 1,
                                             "store_uri": "s", "train_config": dataclasses.asdict(cfg)})


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("family", ["eagle3", "peagle", "dflash"])
def test_a_full_vocabulary_draft_exports_without_a_vocabulary_map(tmp_path, tiny_target, family, fmt):
    ckpt = full_vocab_checkpoint(family, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=fmt, off_policy=True)
    cfg = json.loads((out / "config.json").read_text())
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    assert cfg["draft_vocab_size"] == vocab
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not names & {"d2t", "t2d"}, names  # vLLM has no parameter to load them into
    assert any(n.endswith("lm_head.weight") for n in names)
    check_draft_dir(out, json.loads((tiny_target / "config.json").read_text()))  # serve up's own check passes


def test_vllm_serves_a_full_vocabulary_dflash_draft(tmp_path, tiny_target):
    """One engine: the export loads in vLLM and drafts (it failed at engine start)."""
    from eaglenest.serve.draft_check import _run

    ckpt = full_vocab_checkpoint("dflash", tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, off_policy=True)
    outputs, metrics = _run(str(tiny_target), [[5, 6, 7, 8, 9]], 8, draft=str(out), num_spec=2, mem=0.15,
                            max_len=256, dtype="float32")
    assert len(outputs) == 1 and len(outputs[0]) == 8
    assert metrics["spec_decode_num_draft_tokens"] > 0


def test_serving_refuses_a_full_vocabulary_export_that_still_holds_d2t(tmp_path, tiny_target):
    """An export made before the fix (``d2t`` written for the whole vocabulary): refused before vLLM
    starts, in one line naming the file, instead of failing once the engine loads it."""
    from safetensors.torch import load_file, save_file

    from eaglenest.errors import ConfigError

    ckpt = full_vocab_checkpoint("eagle3", tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, off_policy=True)
    state = load_file(str(out / "model.safetensors"))
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    save_file({**state, "d2t": torch.zeros(vocab, dtype=torch.int64)}, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"model.safetensors: a d2t tensor, which vLLM refuses .*export the draft "
                                          r"again"):
        check_draft_dir(out)
