"""The exported draft's model card (``README.md``, serve/cards.py), hostile pass 12.

* A whole-vocabulary draft is exported without ``d2t`` / ``t2d``, yet its card said "``d2t`` holds offsets".
* The card's Python and shell snippets put the target path inside double quotes (or none) as it was: a path
  holding ``"``, ``\\``, a space or a newline broke the snippet. Each snippet is parsed here (``ast`` for Python,
  ``shlex`` for shell) and the value read back must be the path.
* A target pinned at a hub revision (``run.target_revision``, or the revision the feature identity records for a
  hub id) was named without it: a reader of the card loaded ``main``.

No engine: the card functions are called on the configs export writes, and one real export for the vocabulary."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex

import pytest
import torch
from safetensors import safe_open

from eaglenest.serve import formats
from eaglenest.serve.cards import dflash_card, model_card
from eaglenest.serve.export import export_draft
from eaglenest.target import pin_revision
from eaglenest.train.checkpoint import save_checkpoint
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import build_draft
from eaglenest.train.target import load_target_tensors
from eaglenest.train.vocab import select_vocab

HOSTILE = ['/models/my "best" target', "C:\\models\\t\\new", "/models/two\nlines", "/models/it's `odd` | $HOME",
           "/models/émoji 🦅", "/a '\"\\'"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cfg(**over) -> dict:
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
           "draft_vocab_size": 1024, "vocab_size": 2048, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "torch_dtype": "float32",
           **{flag: False for flag in formats.FLAGS}}
    return {**cfg, **over}


def _dflash_cfg(**over) -> dict:
    return _cfg(architectures=["DFlashDraftModel"], num_hidden_layers=1, block_size=4,
                dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 7, "causal": False}, **over)


def _inputs(target: str, identity: dict | None = None) -> dict:
    return {"target": target, "store_uri": "/s", "table": "features", "version": 1,
            "feature_identity": json.dumps(identity) if identity is not None else None}


def _cards(target: str, identity: dict | None = None, cfg_over: dict | None = None) -> dict[str, str]:
    """Every card kind: EAGLE-3 and P-EAGLE, DFlash, each in both formats."""
    inputs, over = _inputs(target, identity), cfg_over or {}
    info = {"step": 1, "metrics": {}, "train_config": {}}
    out = {}
    for fmt in ("vllm", "speculators"):
        out[f"eagle3-{fmt}"] = model_card(_cfg(**over), info, inputs, format=fmt)
        out[f"peagle-{fmt}"] = model_card(_cfg(parallel_drafting=True, mask_token_id=9, **over), info, inputs,
                                          format=fmt)
        out[f"dflash-{fmt}"] = dflash_card(_dflash_cfg(**over), info, inputs, format=fmt)
    return out


def _llm_calls(card: str) -> list[dict]:
    """The keyword arguments (literal values) of every ``LLM(...)`` call in the card's Python blocks, each
    block parsed as Python."""
    calls = []
    for block in re.findall(r"```python\n(.*?)\n```", card, flags=re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LLM":
                calls.append({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords})
    assert calls, card
    return calls


@pytest.mark.parametrize("target", HOSTILE)
def test_python_snippets_name_the_target_path_exactly(target):
    named = []
    for kind, card in _cards(target).items():
        for call in _llm_calls(card):
            if call["model"] != "<this directory>":  # the speculators layout names the target in config.json
                named.append(kind)
                assert call["model"] == target, kind
            assert "revision" not in call, kind  # a local path: no revision
    assert named == ["eagle3-vllm", "peagle-vllm", "dflash-vllm"]


@pytest.mark.parametrize("target", HOSTILE + ["/models/plain"])
def test_the_speculators_convert_command_names_the_target_path_exactly(target):
    card = _cards(target)["eagle3-vllm"]
    blocks = [b for _, b in re.findall(r"^(`{3,})shell\n(.*?)\n\1$", card, flags=re.S | re.M)]
    assert len(blocks) == 1 and blocks[0].startswith("speculators convert <this directory> "), card
    command = blocks[0]
    words = shlex.split(command)
    assert words[words.index("--verifier") + 1] == target
    kwargs = json.loads(words[words.index("--algorithm-kwargs") + 1])
    assert kwargs["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_a_pinned_revision_goes_in_every_python_snippet():
    pin_revision("acme/tiny", "v1.0")
    try:
        cards = _cards("acme/tiny")
    finally:
        pin_revision("acme/tiny", "")
    for kind, card in cards.items():
        for call in _llm_calls(card):
            assert call["revision"] == "v1.0", kind
        assert "`acme/tiny` at revision `v1.0`" in card, kind


def test_the_revision_the_feature_identity_records_for_the_hub_id_goes_in_the_snippets():
    identity = {"target": "acme/tiny", "weights_sha256": "hub:acme/tiny", "target_revision": COMMIT}
    for kind, card in _cards("acme/tiny", identity).items():
        assert all(call["revision"] == COMMIT for call in _llm_calls(card)), kind
    # The identity of another target (the draft exported with a local copy) names no revision for this one.
    for kind, card in _cards("/models/tiny", identity).items():
        assert all("revision" not in call for call in _llm_calls(card)), kind
        assert "at revision" not in card, kind


def test_the_vocabulary_map_line_says_what_the_export_holds():
    reduced = _cards("/models/t")
    full = _cards("/models/t", cfg_over={"draft_vocab_size": 2048})
    for kind in reduced:
        assert "`d2t` holds offsets: `target_id = draft_id + d2t[draft_id]`" in reduced[kind], kind
        assert "d2t` holds offsets" not in full[kind], kind
        assert "no `d2t` / `t2d`" in full[kind], kind


def test_a_whole_vocabulary_export_card_names_no_d2t(tmp_path, tiny_target):
    t = load_target_tensors(tiny_target)
    vocab_size = int(t["config"]["vocab_size"])
    cfg = TrainConfig(draft_vocab_size=vocab_size, ttt_steps=2)
    vocab = select_vocab(torch.randint(0, 100, (vocab_size,), generator=torch.Generator().manual_seed(0)).numpy(),
                         vocab_size)
    model = build_draft(cfg, t, layer_ids=(2, 4, 5), vocab=vocab, seed=0)
    ckpt = save_checkpoint(tmp_path / "train", model, info={"layer_ids": [2, 4, 5], "step": 0, "table_version": 1,
                                                            "store_uri": "s", "train_config": dataclasses.asdict(cfg)})
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, off_policy=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not set(f.keys()) & {"d2t", "t2d"}
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "holds offsets" not in card and "no `d2t` / `t2d`" in card


def test_a_target_path_that_is_not_utf8_exports_a_card(tmp_path, tiny_target, toy_checkpoint):
    """A Linux path may hold bytes that are not UTF-8 (Python reads them as surrogates): the card, written as
    UTF-8, stopped the export with a UnicodeEncodeError traceback. Its Python snippet names the path exactly."""
    import os
    import shutil

    target = tmp_path / os.fsdecode(b"target-\xff")
    shutil.copytree(tiny_target, target)
    out = export_draft(toy_checkpoint, tmp_path / "draft", target_dir=target, off_policy=True)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert [call["model"] for call in _llm_calls(card)] == [str(target)]
    assert "target-\\udcff`" in card.split("```")[0]  # the prose shows the byte escaped


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (a ``\\|`` is text inside a cell, not a border)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


@pytest.mark.parametrize("kind", ["eagle3-vllm", "dflash-vllm"])
def test_a_store_path_holding_a_bar_or_newline_stays_one_table_cell(kind):
    inputs = {**_inputs("/models/t"), "store_uri": "/data/a|b\nc `x`"}
    info = {"step": 1, "metrics": {}, "train_config": {}}
    card = (dflash_card(_dflash_cfg(), info, inputs) if kind.startswith("dflash")
            else model_card(_cfg(), info, inputs))
    rows = [line for line in card.splitlines() if line.startswith("| features |")]
    assert len(rows) == 1, card
    cells = _cells(rows[0])
    assert len(cells) == 2 and cells[1].startswith("`` /data/a\\|b\\nc `x` `` table `features`"), cells


def test_an_export_of_a_pinned_hub_target_names_its_revision(tmp_path, tiny_target, toy_checkpoint, monkeypatch):
    """End to end: ``run.target_revision`` pins the hub id the export reads from a local Hugging Face cache; the
    card's snippet reads the target at that commit, not at ``main``."""
    import shutil

    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    shutil.copytree(tiny_target, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("f" * 40)  # main is elsewhere: the pin is what the export read
    pin_revision("acme/tiny", COMMIT)
    try:
        out = export_draft(toy_checkpoint, tmp_path / "draft", target_dir="acme/tiny", off_policy=True)
    finally:
        pin_revision("acme/tiny", "")
    calls = _llm_calls((out / "README.md").read_text(encoding="utf-8"))
    assert calls == [{"model": "acme/tiny", "revision": COMMIT, "speculative_config": calls[0]["speculative_config"]}]
