"""Mutation audit 12 of ``serve export`` (config fields, vocabulary maps, weight names): each test checks
one behaviour from first principles (the module the draft was trained as, vLLM's own readers, an
invariant of the maps) where a plausible slip in the export survived the earlier tests."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eaglenest.errors import EaglenestError
from eaglenest.serve.export import export_draft
from eaglenest.train.checkpoint import FORMAT, INFO, WEIGHTS, save_checkpoint, weights_digest
from eaglenest.train.config import TrainConfig
from eaglenest.train.loop import build_draft
from eaglenest.train.model import Eagle3Draft
from eaglenest.train.target import load_target_tensors
from eaglenest.train.vocab import select_vocab


def test_a_flag_checkpoint_json_leaves_out_is_exported_as_the_draft_computed_it(tmp_path, toy_checkpoint, tiny_target):
    """A checkpoint whose draft_config predates ``norm_before_residual`` (the draft's layer reads it with
    ``getattr(..., False)``) trained without it: vLLM's EAGLE-3 default is True, so the export must write
    the value the trained module used, not a default of its own."""
    ckpt = shutil.copytree(toy_checkpoint, tmp_path / "old")
    info = json.loads((ckpt / "checkpoint.json").read_text())
    del info["draft_config"]["norm_before_residual"]
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    with torch.device("meta"):
        trained = Eagle3Draft(LlamaConfig.from_dict(info["draft_config"]))
    cfg = json.loads((export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target) / "config.json").read_text())
    assert cfg["norm_before_residual"] is trained.midlayer.norm_before_residual is False


def _rewrite(ckpt, change_info=None, change_state=None):
    """``ckpt`` (a copy) with checkpoint.json and/or its weights changed, as one run would have saved the
    pair (the weights' digest recomputed)."""
    info = json.loads((ckpt / INFO).read_text())
    if change_state is not None:
        state = load_file(str(ckpt / WEIGHTS))
        change_state(state)
        info["weights_sha256"] = weights_digest(state)
        save_file(state, str(ckpt / WEIGHTS), metadata={"format": FORMAT, "weights_sha256": info["weights_sha256"]})
    if change_info is not None:
        change_info(info)
    (ckpt / INFO).write_text(json.dumps(info))
    return ckpt


def _refused(ckpt, out, target, match, **kw):
    with pytest.raises(EaglenestError, match=match) as err:
        export_draft(ckpt, out, target_dir=target, **kw)
    assert "\n" not in str(err.value) and not out.exists()


@pytest.fixture(scope="module")
def peagle_checkpoint(tmp_path_factory, tiny_target):
    """An untrained P-EAGLE checkpoint of the tiny target (draft vocab 1024, aux layers 2, 4, 5)."""
    cfg = TrainConfig(family="peagle", draft_vocab_size=1024)
    model = build_draft(cfg, load_target_tensors(tiny_target), layer_ids=(2, 4, 5),
                        vocab=select_vocab(torch.arange(2048, 0, -1).numpy(), 1024), seed=0)
    return save_checkpoint(tmp_path_factory.mktemp("peagle") / "train", model, info={
        "layer_ids": [2, 4, 5], "step": 1, "table_version": 1, "store_uri": "s",
        "train_config": dataclasses.asdict(cfg)})


def test_a_mask_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path, peagle_checkpoint, tiny_target):
    """The mask token is a target token id (vLLM embeds it with the target's embeddings): ``vocab_size``
    itself is one past the last."""
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    ckpt = _rewrite(shutil.copytree(peagle_checkpoint, tmp_path / "ck"),
                    change_info=lambda i: i["draft_config"].update(mask_token_id=vocab))
    _refused(ckpt, tmp_path / "draft", tiny_target, rf"mask_token_id: a token id .*got {vocab}")


def test_an_old_dflash_checkpoint_with_one_negative_mlp_bias_is_refused(tmp_path, dflash_bias_checkpoint):
    """Only biases that are all exactly zero compute nothing: a single negative entry among zeros is a
    trained bias vLLM would drop, refused like any other."""
    ckpt, target = dflash_bias_checkpoint

    def add_biases(state):
        for name in [n for n in state if ".mlp." in n and n.endswith(".weight")]:
            state[name[: -len("weight")] + "bias"] = torch.zeros(state[name].shape[0])
        state["layers.0.mlp.down_proj.bias"][3] = -1e-3
    old = _rewrite(shutil.copytree(ckpt, tmp_path / "ck"), change_state=add_biases,
                   change_info=lambda i: i["draft_config"].update(mlp_bias=True))
    _refused(old, tmp_path / "draft", target, r"MLP biases \(layers\.0\.mlp\.down_proj\.bias", off_policy=True)


def test_a_whole_vocabulary_draft_whose_map_permutes_ids_is_refused(tmp_path, tiny_target):
    """A draft of the target's whole vocabulary is exported without d2t (vLLM has no map to load it into and
    takes draft ids as target ids): a d2t that is a valid bijection but not the identity (draft ids 0 and 1
    swapped) would then be dropped and the draft's logits served under the other ids. Refused instead."""
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    cfg = TrainConfig(draft_vocab_size=vocab)
    model = build_draft(cfg, load_target_tensors(tiny_target), layer_ids=(2, 4, 5),
                        vocab=select_vocab(torch.arange(vocab, 0, -1).numpy(), vocab), seed=0)
    ckpt = save_checkpoint(tmp_path / "train", model, info={"layer_ids": [2, 4, 5], "step": 1, "table_version": 1,
                                                              "store_uri": "s", "train_config": {}})
    _rewrite(ckpt, change_state=lambda s: s["d2t"][:2].copy_(torch.tensor([1, -1])))
    _refused(ckpt, tmp_path / "draft", tiny_target, "d2t maps draft id 0 to another target id")


def test_weights_lacking_one_of_the_drafts_tensors_are_refused(tmp_path, toy_checkpoint, tiny_target):
    """Every tensor of the draft checkpoint.json describes must be in its weights: written without one, vLLM
    would stop at load (or leave the parameter at its initial values), far from the cause."""
    ckpt = _rewrite(shutil.copytree(toy_checkpoint, tmp_path / "ck"),
                    change_state=lambda s: s.pop("midlayer.mlp.down_proj.weight"))
    _refused(ckpt, tmp_path / "draft", tiny_target, r"no tensor midlayer\.mlp\.down_proj\.weight \(1 missing\)")


def test_a_model_folder_with_another_stages_provenance_is_never_replaced(tmp_path, toy_checkpoint, tiny_target):
    """A folder of export's four file names (a model written by another eaglenest stage: config.json with
    architectures, weights, card, provenance.json of that stage) is not an earlier export: refused, kept."""
    out = tmp_path / "model"
    out.mkdir()
    files = {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"]}), "model.safetensors": "weights",
             "README.md": "card", "provenance.json": json.dumps({"stage": "tinytarget build", "inputs": {}})}
    for name, text in files.items():
        (out / name).write_text(text)
    with pytest.raises(EaglenestError, match="holds files that are not an exported draft"):
        export_draft(toy_checkpoint, out, target_dir=tiny_target)
    assert {p.name: p.read_text() for p in out.iterdir()} == files
