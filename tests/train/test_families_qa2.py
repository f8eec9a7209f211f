"""QA of the parallel drafters end to end (P-EAGLE and DFlash beside EAGLE-3): train -> export ->
evaluate, on unusual but legal shapes and on hand-damaged inputs. Each case either works (the
exported draft proposes what the trained one does) or is refused in one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eaglenest.errors import ConfigError
from eaglenest.evaluate.offline import load_draft, propose
from eaglenest.serve.export import export_draft
from eaglenest.train import dflash, peagle
from eaglenest.train.config import DFlashConfig, PEagleConfig, TrainConfig
from eaglenest.train.ttt import Batch

COMMITTED_TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-target"


def _proposals(draft, seq: list[int], k: int) -> list[list[int]]:
    """The draft's greedy proposals for every prefix of ``seq`` (random features, seeded)."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(len(seq), draft.fc.in_features, generator=g)
    with torch.no_grad():
        feats = draft.combine(aux)
        return [propose(draft, seq[:n], feats[: n - 1], k) for n in range(2, len(seq) + 1)]


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_offline_loads_a_speculators_export_as_trained(tmp_path, synth, tiny_target, family):
    """``evaluate offline`` on a ``serve.format=speculators`` export (Eagle-3 or P-EAGLE): it was
    refused as "unreadable or not matching config.json ...: export the draft again", which a new
    export cannot fix (speculators' ``layers.0.*`` names and ``transformer_layer_config`` were read
    as the flat vLLM layout). It now loads and proposes exactly what the train checkpoint does."""
    cfg = TrainConfig(family=family, draft_vocab_size=16, ttt_steps=2, peagle=PEagleConfig(num_slots=2))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format="speculators")
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == family
    trained, served = load_draft(ckpt, tiny_target), load_draft(out, tiny_target)
    assert (served.mask_hidden is not None) == (family == "peagle")
    seq = [5, 9, 17, 3, 44, 100, 7]
    assert _proposals(served, seq, 3) == _proposals(trained, seq, 3)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_offline_loads_a_dflash_export_as_trained(tmp_path, synth, tiny_target, fmt):
    """``evaluate offline`` on a DFlash export (``<workdir>/draft`` after a DFlash run, either format)
    was refused ("name the train checkpoint it was exported from"): a draft handed over without its
    train folder could not be estimated. It now loads and proposes exactly what the checkpoint does."""
    cfg = TrainConfig(family="dflash", draft_vocab_size=8, dflash=DFlashConfig(block_size=3, num_layers=2))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target, format=fmt, dtype="float32")
    trained, served = load_draft(ckpt, tiny_target), load_draft(out, tiny_target, key="--draft")
    assert dflash.is_dflash(served.config) and len(served.layers) == 2
    assert served.config.eagle_aux_layer_ids == trained.config.eagle_aux_layer_ids
    assert (served.config.mask_token_id, served.config.dflash_block_size) == (trained.config.mask_token_id, 3)
    ref, got = trained.state_dict(), served.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(t, ref[n]) for n, t in got.items()), "weights differ"
    seq = [5, 9, 17, 3, 44, 100, 7]
    assert _proposals(served, seq, 2) == _proposals(trained, seq, 2)


def test_offline_names_the_key_of_a_damaged_dflash_export(tmp_path, synth, tiny_target):
    cfg = TrainConfig(family="dflash", draft_vocab_size=8, dflash=DFlashConfig(block_size=2, num_layers=1))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    raw = json.loads((out / "config.json").read_text())
    del raw["dflash_config"]["mask_token_id"]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_draft(out, tiny_target, key="--draft")
    assert str(err.value).startswith(f"--draft: {out / 'config.json'}: not a DFlash draft config (")
    assert "mask_token_id" in str(err.value) and "export the draft again" in str(err.value)


@pytest.fixture(scope="module")
def other_targets(tmp_path_factory, synth):
    """Targets the drafts were not trained for: another width, another vocabulary, fewer layers."""
    tmp = tmp_path_factory.mktemp("other_targets")
    return {"hidden_size 64": synth.make_target(tmp / "wide", hidden_size=64, intermediate_size=128),
            "vocab_size 1024": synth.make_target(tmp / "vocab", vocab_size=1024),
            "5 layers": synth.make_target(tmp / "short", num_hidden_layers=5)}


@pytest.mark.parametrize("family", ["peagle", "dflash"])
@pytest.mark.parametrize("what", ["hidden_size 64", "vocab_size 1024", "5 layers"])
def test_offline_refuses_a_target_the_draft_was_not_trained_for(tmp_path, synth, tiny_target, other_targets,
                                                                 family, what):
    """``evaluate offline`` / ``evaluate parity`` with ``run.target`` another model than the draft's:
    the checkpoint was called damaged ("the checkpoint is damaged: train again") and an export raised
    a bare RuntimeError from the embedding copy (a wider or narrower vocabulary or width), or an
    IndexError mid-decode (an aux layer the target lacks). Now one line naming run.target and what differs."""
    cfg = TrainConfig(family=family, draft_vocab_size=16, dflash=DFlashConfig(num_layers=1, block_size=3))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    drafts = [ckpt] + ([export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)] if family == "peagle" else [])
    for draft in drafts:
        with pytest.raises(ConfigError) as err:
            load_draft(draft, other_targets[what], key="--draft")
        msg = str(err.value)
        assert msg.startswith("run.target: ") and "\n" not in msg and "damaged" not in msg, msg
        assert (what if "layers" not in what else "aux layers [5]") in msg, msg
    assert load_draft(ckpt, tiny_target).config.vocab_size == 2048  # the right target still loads


@pytest.mark.parametrize("family", ["peagle", "dflash"])
@pytest.mark.parametrize("bad", [2048, -1, "x", None, 2.5, True])
def test_offline_refuses_a_mask_token_outside_the_vocabulary(tmp_path, synth, tiny_target, family, bad):
    """A hand-edited ``draft_config.mask_token_id`` (checkpoint.json) past the target's vocabulary, or
    not an id: ``evaluate offline`` / ``parity`` loaded it and died mid-decode with a bare IndexError
    ("index out of range in self") or ValueError/TypeError from ``int()``, or read 2.5 as token 2."""
    cfg = TrainConfig(family=family, draft_vocab_size=16, dflash=DFlashConfig(num_layers=1, block_size=3))
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    info = json.loads((ckpt / "checkpoint.json").read_text())
    info["draft_config"]["mask_token_id"] = bad
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    with pytest.raises(ConfigError) as err:
        load_draft(ckpt, tiny_target, key="--draft")
    assert str(err.value) == (f"--draft: {ckpt / 'checkpoint.json'}: mask_token_id {bad!r} is not a token id of "
                              "the target's vocabulary (0..2047); the checkpoint is damaged: train again "
                              "(`train run`)")


def test_offline_refuses_a_peagle_export_whose_mask_token_is_outside_the_vocabulary(tmp_path, synth, tiny_target):
    cfg = TrainConfig(family="peagle", draft_vocab_size=16)
    ckpt = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    out = export_draft(ckpt, tmp_path / "draft", target_dir=tiny_target)
    raw = json.loads((out / "config.json").read_text())
    raw["mask_token_id"] = 5000
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_draft(out, tiny_target, key="--draft")
    assert str(err.value) == (f"--draft: {out / 'config.json'}: mask_token_id 5000 is not a token id of the "
                              "target's vocabulary (0..2047); export the draft again (`serve export`)")


@pytest.mark.parametrize("family", [peagle, dflash])
def test_more_anchors_per_row_than_positions_means_every_candidate(family):
    """``train.peagle.anchors_per_row`` / ``train.dflash.anchors_per_row`` above the row's length (a
    user asking for "every position"): the anchors were padded to that count, so the one forward built
    an [A*(slots-1)]^2 mask (10**6 anchors of a 12-token row: terabytes, an allocation error). A row
    has at most one anchor per position: the width is capped there, the draw is unchanged."""
    rows, t = 2, 12
    docs = torch.tensor([[0] * 7 + [1] * 5, [0] * 10 + [-1] * 2])
    batch = Batch(input_ids=torch.arange(rows * t).view(rows, t) % 50 + 3, loss_mask=docs >= 0, doc_ids=docs,
                  position_ids=torch.tensor([list(range(7)) + list(range(5)), list(range(10)) + [0, 0]]),
                  aux=None, last_hidden=None)
    every = family.sample_anchors(batch, num_anchors=10**6, seed=0, step=3)
    exact = family.sample_anchors(batch, num_anchors=t, seed=0, step=3)
    assert every.anchors.shape == every.anchor_ok.shape == (rows, t)
    assert torch.equal(every.anchors, exact.anchors) and torch.equal(every.anchor_ok, exact.anchor_ok)
    assert 0 < int(every.anchor_ok.sum()) < rows * t  # real anchors, and padding where a row has fewer


@pytest.mark.parametrize("trained, served", [("peagle", "dflash"), ("dflash", "peagle"), ("eagle3", "peagle"),
                                             ("peagle", "eagle3")])
def test_parity_refuses_a_checkpoint_of_another_family_before_an_engine_starts(tmp_path, synth, tiny_target,
                                                                               monkeypatch, trained, served):
    """``evaluate parity --checkpoint <a P-EAGLE run's train/>`` against a DFlash export (two runs in
    one workdir, or a hand-edited checkpoint.json): an engine was started and every round reported as
    "departs from the trained checkpoint" (exit 1), as if the export were broken."""
    from eaglenest.evaluate import parity

    def start(**_kw):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(parity, "served_proposals", start)
    shapes = dict(draft_vocab_size=16, dflash=DFlashConfig(num_layers=1, block_size=3), ttt_steps=2)
    ckpt = synth.untrained_checkpoint(TrainConfig(family=trained, **shapes), tiny_target, tmp_path / "a" / "train")
    other = synth.untrained_checkpoint(TrainConfig(family=served, **shapes), tiny_target, tmp_path / "b" / "train")
    draft = export_draft(other, tmp_path / "b" / "draft", target_dir=tiny_target,
                         format="speculators" if served == "peagle" else "vllm")
    with pytest.raises(ConfigError) as err:
        parity.parity_check(target=tiny_target, draft=draft, checkpoint=ckpt, prompts={"p": [5, 6, 7]}, k=2,
                            max_tokens=4, engine=None, min_identical=1.0, checkpoint_key="--checkpoint")
    assert str(err.value) == (f"--checkpoint: {ckpt} is a {trained} draft, the served draft {draft} a {served} one: "
                              "name the train checkpoint it was exported from")


def test_a_peagle_card_does_not_offer_the_eagle3_converter(tmp_path, synth, tiny_target):
    """The vLLM-format P-EAGLE card told speculators users to run ``speculators convert --algorithm
    eagle3``: speculators 0.9 has no P-EAGLE conversion, its Eagle-3 one drops ``mask_hidden`` (an
    unexpected key, a warning) and writes ``speculators_model_type: eagle3``, which vLLM serves
    sequentially: not as trained. The card now names the format that keeps it, and says why."""
    cards = {}
    for family in ("eagle3", "peagle"):
        ckpt = synth.untrained_checkpoint(TrainConfig(family=family, draft_vocab_size=16), tiny_target,
                                          tmp_path / family / "train")
        out = export_draft(ckpt, tmp_path / family / "draft", target_dir=tiny_target)
        cards[family] = (out / "README.md").read_text().split("## Readers", 1)[1]
    assert "speculators convert <this directory> --algorithm eagle3" in cards["eagle3"]  # right for Eagle-3
    assert "speculators convert <this directory>" not in cards["peagle"]
    assert ("- speculators: export with `serve.format=speculators` (`speculators_model_type: peagle`); "
            "`speculators convert` has no P-EAGLE algorithm") in cards["peagle"]


@pytest.mark.parametrize("family, fmt", [("peagle", "checkpoint"), ("peagle", "speculators"), ("dflash", "checkpoint")])
def test_offline_past_the_trained_depth_warns_as_serving_does(tmp_path, synth, caplog, family, fmt):
    """``evaluate offline`` with K past the depth the draft was trained for (a 2-slot P-EAGLE or a block-2
    DFlash draft at K=3, e.g. the default K of a checkpoint, which records no K): it replayed silently,
    where ``serve up`` / ``evaluate al`` warn (eaglenest.engine.speculative_config)."""
    import logging

    from eaglenest.evaluate.offline import offline_al

    tiny_target = COMMITTED_TARGET  # it has a tokenizer (offline_al loads one)
    cfg = TrainConfig(family=family, draft_vocab_size=16, peagle=PEagleConfig(num_slots=2),
                      dflash=DFlashConfig(num_layers=1, block_size=2))
    draft = synth.untrained_checkpoint(cfg, tiny_target, tmp_path / "train")
    if fmt == "speculators":
        draft = export_draft(draft, tmp_path / "draft", target_dir=tiny_target, format="speculators")
    depth = 2 if family == "peagle" else 1
    groups = {"g": [{"prompt_token_ids": [5, 6, 7, 8], "sample_id": "a"}]}
    for k in (depth, 3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="eaglenest.evaluate.offline"):
            report = offline_al(target=tiny_target, draft=draft, groups=groups, num_speculative_tokens=k,
                                max_tokens=4, ignore_eos=True)
        assert len(report["outputs"]["a"]) == 4
        warned = [r.getMessage() for r in caplog.records if "past the" in r.getMessage()]
        assert warned == ([] if k == depth else [
            f"evaluate.num_speculative_tokens 3 is past the {depth} tokens a round the draft {draft} was trained to "
            f"draft: its proposals past {depth} come from positions it never learnt"])


@pytest.mark.parametrize("parallel", [False, True])
def test_the_card_snippet_serves_the_recommended_k(parallel):
    """The vLLM-format card's snippet served every EAGLE-3 / P-EAGLE draft at K=3, past the depth of a
    2-slot P-EAGLE (or ttt_steps=2) draft, whose recommended K is 2."""
    from eaglenest.serve import formats

    text = formats.usage_text("vllm", "t", "LlamaForCausalLMEagle3", parallel=parallel, num_speculative_tokens=2)
    want = '"num_speculative_tokens": 2' + (', "parallel_drafting": True' if parallel else "") + "})"
    assert want in text and '"num_speculative_tokens": 3' not in text
