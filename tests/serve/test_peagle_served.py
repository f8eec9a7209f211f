"""P-EAGLE (train.family=peagle) exported and served by real vLLM with parallel drafting.

The export: the EAGLE-3 format plus ``mask_token_id``, ``parallel_drafting`` and the ``mask_hidden``
tensor, and every caller's speculative config gets ``parallel_drafting`` from it. Served: one store
written without an engine (the committed tiny target's own greedy answers, features from a
transformers forward: tests/archs/arch_helpers.py), a short ``train run`` with
``train.family=peagle``, ``serve export``, ``evaluate al``: every output token-identical to the
target alone, vLLM's rounds equal to the offline replay of the trained checkpoint (evaluate offline
replays vLLM's parallel drafting: train/peagle.py ``propose``), and served AL above what a garbage draft gets (the same export with every weight
replaced by noise of the same scale serves AL 1.00 on these prompts, measured; this draft ~1.57).

Also exported in speculators' layout (``serve.format=speculators``: ``speculators_model_type:
peagle``): what vLLM reads from it, checked with vLLM's own config code, and served as trained
(``evaluate parity``: every proposal vLLM makes from it, round by round, is the one the train
checkpoint makes). The offline proposer that replay uses is P-EAGLE's training forward (tested
without an engine).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eaglenest.engine import speculative_config
from eaglenest.errors import ConfigError
from eaglenest.evaluate.offline import load_draft
from eaglenest.serve.export import export_draft
from eaglenest.train import peagle
from eaglenest.train.checkpoint import read_info
from eaglenest.train.config import recommended_num_speculative_tokens

_spec = importlib.util.spec_from_file_location(
    "_eaglenest_test_arch_helpers_peagle", Path(__file__).parent.parent / "archs" / "arch_helpers.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

#: Served AL the trained P-EAGLE draft must reach (measured: 1.575; a garbage draft 1.00).
AL_FLOOR = 1.4
PEAGLE = {"family": "peagle", "peagle": {"num_slots": 3, "anchors_per_row": 32}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target):
    """The tiny target's store (no engine) and a P-EAGLE draft trained on it and exported."""
    base = H.Run("tiny", tmp_path_factory.mktemp("peagle-store"), target=tiny_target)
    H.write_prompts(base.store, base.target, on_policy=True)
    H.hf_features(base.store, base.target, layer_ids=(2, 4, 5))
    run = H.Run("tiny", tmp_path_factory.mktemp("peagle"), train={**H.SERVED_TRAIN, **PEAGLE},
                target=base.target, store=base.store)
    assert run.cli("train", "run") == 0 and run.cli("serve", "export") == 0
    return run


def test_export_carries_the_mask_and_serving_turns_parallel_drafting_on(trained, tmp_path):
    draft = trained.work / "draft"
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["parallel_drafting"] is True and cfg["mask_token_id"] == 0  # the tiny target's pad id
    weights = load_file(str(draft / "model.safetensors"))
    ckpt = load_file(str(trained.work / "train" / "draft.safetensors"))
    assert weights["mask_hidden"].shape == (3 * cfg["target_hidden_size"],)
    assert torch.equal(weights["mask_hidden"], ckpt["mask_hidden"])
    assert speculative_config(str(draft), 3) == {"method": "eagle3", "model": str(draft),
                                                 "num_speculative_tokens": 3, "parallel_drafting": True}
    assert "parallel_drafting" in (draft / "README.md").read_text()
    with pytest.raises(ConfigError, match="serve.format"):  # speculators' layout: P-EAGLE yes, quantised no
        export_draft(trained.work / "train", tmp_path / "spec", target_dir=trained.target, format="speculators",
                     quantization="fp8")
    assert not (tmp_path / "spec").exists()


def test_an_eagle3_export_is_served_sequentially(trained, tmp_path):
    """Without the config key (an EAGLE-3 export), the speculative config has no parallel_drafting."""
    plain = tmp_path / "plain"
    plain.mkdir()
    cfg = json.loads((trained.work / "draft" / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "parallel_drafting"}))
    assert "parallel_drafting" not in speculative_config(str(plain), 3)


@pytest.mark.slow
def test_peagle_draft_served_lossless_above_the_floor_and_as_trained(trained):
    """Served AL above the floor, and vLLM's rounds equal the offline replay of its parallel drafting
    with the train checkpoint (evaluate offline, fp32): round by round in total."""
    H.assert_served_as_trained(trained, "P-EAGLE", AL_FLOOR)


def test_peagle_speculators_export_as_vllm_reads_it(trained, tmp_path):
    draft = H.speculators_export(trained, tmp_path)
    raw = json.loads((draft / "config.json").read_text())
    assert raw["speculators_model_type"] == "peagle" and raw["architectures"] == ["PEagleSpeculator"]
    assert raw["speculators_config"]["algorithm"] == "peagle" and raw["mask_token_id"] == 0
    # K: what the export states (its proposal; the family's recommended K for this checkpoint) is what vLLM drafts.
    k = raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == recommended_num_speculative_tokens(read_info(trained.work / "train")["train_config"]) >= 1
    target, spec, hf = H.as_vllm_reads_it(draft)
    assert spec == {"method": "eagle3", "parallel_drafting": True, "model": str(draft), "num_speculative_tokens": k}
    assert Path(target) == Path(trained.target)
    assert hf["architectures"] == ["PeagleLlamaForCausalLM"] and hf["pard_token"] == 0
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    vllm_cfg = json.loads((trained.work / "draft" / "config.json").read_text())
    for flag in ("norm_before_fc", "norm_before_residual"):  # vLLM's peagle defaults differ from eagle3's
        assert hf[flag] == vllm_cfg[flag], flag
    assert speculative_config(str(draft), 3)["parallel_drafting"] is True
    # Same tensors as the vLLM-format export, the block as layers.0, mask_hidden kept.
    ours, theirs = load_file(str(draft / "model.safetensors")), load_file(str(trained.work / "draft" /
                                                                            "model.safetensors"))
    assert {n.replace("layers.0.", "midlayer.") for n in ours} == set(theirs)
    assert all(torch.equal(t, theirs[n.replace("layers.0.", "midlayer.")]) for n, t in ours.items())
    assert "parallel_drafting" in (draft / "README.md").read_text()


@pytest.mark.slow
def test_peagle_speculators_export_proposes_what_the_checkpoint_proposes(trained, tmp_path):
    draft = H.speculators_export(trained, tmp_path)
    code, report = H.parity(trained, draft, tmp_path / "parity")
    print(f"\nP-EAGLE speculators export: {report['rounds']} rounds, identical by position "
          f"{report['identical_by_position']}")
    assert code == 0 and report["passed"], report["first_difference"]
    assert report["rounds"] >= 20 and report["num_speculative_tokens"] == 3
    assert report["identical_by_position"] == [1.0] * 3 and report["first_difference"] is None


def test_the_peagle_proposer_is_the_training_forward(trained):
    """P-EAGLE's offline proposer gives the argmax the training forward computes at its anchor's slots."""
    draft = load_draft(trained.work / "train", trained.target)
    gen = torch.Generator().manual_seed(0)
    t, n_aux = 9, len(draft.config.eagle_aux_layer_ids)
    # The training row is one longer: its depth-0 token at t-1 is x_t (the round's bonus token); the
    # extra position t is seen by neither the anchor t-1 nor its slots.
    aux = torch.randn(1, t + 1, n_aux * draft.config.target_hidden_size, generator=gen)
    ids = torch.randint(0, draft.config.vocab_size, (1, t + 1), generator=gen)
    with torch.no_grad():
        got = peagle.propose(draft, ids[0].tolist(), draft.combine(aux[0, :t]), 3)
        zero = torch.zeros(1, t + 1, dtype=torch.long)
        batch = peagle.PEagleBatch(input_ids=ids, loss_mask=zero.bool(), doc_ids=zero,
                                   position_ids=torch.arange(t + 1)[None], aux=aux, last_hidden=None,
                                   anchors=torch.tensor([[t - 1]]), anchor_ok=torch.ones(1, 1, dtype=torch.bool))
        normed = peagle.peagle_forward(draft, batch, 3)
        rows = torch.cat([normed[0, t - 1:t], normed[0, t + 1:]])
    want = draft.draft_to_target(draft.logits(rows).argmax(-1)).tolist()
    assert got == want
