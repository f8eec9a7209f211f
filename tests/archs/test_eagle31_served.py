"""EAGLE-3.1 flags and export correctness under real vLLM: served AL == the offline estimate.

One store, written without an engine (the committed tiny target's own greedy answers to 8 toy
prompts, hidden states from a transformers forward: ``arch_helpers.hf_features``), feeds one short ``train run``
per EAGLE-3.1 flag (``norm_before_fc``, ``fc_norm``, ``norm_output``, ``norm_before_residual``,
each alone). Each draft is exported, served by vLLM 0.32 (``LlamaForCausalLMEagle3`` reads the
flags from config.json) and decoded on the held-out prompts, and its served AL must equal the
offline estimator's (``evaluate offline``, run on the *train checkpoint*) with the same rounds and
accepted tokens: fp32 target and draft, greedy, so the replay is exact. Acceptance must also be far
above what any draft gets for free, and the flag must matter: the same weights loaded with the flag
off in config.json (what a server ignoring it computes) give other logits.

The last test breaks an export on purpose (``fc``'s aux-layer blocks swapped: the draft reads layer
5's features where it was trained on layer 2's) and serves it: its AL is not the offline
estimate's, so the equality above fails on a broken export. (The tiny target, not a random one: a
random target's greedy answers mostly repeat the last token, which a draft learns from the token
alone, and then even a swapped ``fc`` serves the same AL.) One engine per test (no lossless re-run:
tests/archs/test_served.py covers that).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from arch_helpers import (SERVED_TRAIN, Run, draft_outputs, hf_features, served_and_offline, swap_fc_blocks,
                          write_prompts)

pytestmark = pytest.mark.slow

FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
#: Served AL every trained draft must reach (an untrained or garbage draft serves ~1.0-1.1 here).
AL_FLOOR = 1.4
NO_LOSSLESS = "evaluate.check_lossless=false"


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_target):
    """The shared target and store: prompts with the target's own answers, features, no engine."""
    run = Run("tiny", tmp_path_factory.mktemp("eagle31-store"), target=tiny_target)
    write_prompts(run.store, run.target, on_policy=True)
    hf_features(run.store, run.target, layer_ids=(2, 4, 5))
    return run


def _trained(base: Run, work, **flags) -> Run:
    run = Run("tiny", work, train={**SERVED_TRAIN, **flags}, target=base.target, store=base.store)
    assert run.cli("train", "run") == 0 and run.cli("serve", "export") == 0
    return run


def _same(served: dict, offline: dict) -> None:
    s, o = served["overall"], offline["overall"]
    assert s["draft_rounds"] == o["draft_rounds"] and s["accepted_tokens"] == o["accepted_tokens"], (s, o)
    assert s["acceptance_length"] == pytest.approx(o["acceptance_length"], rel=1e-3)
    assert s["acceptance_by_position"] == pytest.approx(o["acceptance_by_position"], abs=1e-3)


@pytest.mark.parametrize("flag", FLAGS)
def test_flagged_draft_served_al_equals_offline(base, tmp_path, flag):
    run = _trained(base, tmp_path, **{flag: True})
    info = json.loads((run.work / "train" / "checkpoint.json").read_text())
    assert math.isfinite(info["metrics"]["loss"]), info["metrics"]
    cfg = json.loads((run.work / "draft" / "config.json").read_text())
    assert cfg[flag] is True and not any(cfg.get(f) for f in FLAGS if f != flag)
    served, offline = served_and_offline(run, NO_LOSSLESS)
    print(f"\n{flag}: served AL {served['overall']['acceptance_length']} / offline "
          f"{offline['overall']['acceptance_length']} over {served['overall']['draft_rounds']} rounds")
    assert served["overall"]["acceptance_length"] >= AL_FLOOR, served["overall"]
    _same(served, offline)
    # The flag changes what the draft computes: the same weights loaded with it off (and without the
    # norm weights it adds: what a server ignoring the flag computes) give other logits. (Acceptance
    # alone need not move: fc_norm over features of similar scale hardly changes the argmax.)
    from safetensors.torch import load_file, save_file

    off = tmp_path / "flag-off"
    shutil.copytree(run.work / "draft", off)
    (off / "config.json").write_text(json.dumps({**cfg, flag: False}))
    extra = {"norm_before_fc": "input_norm.", "fc_norm": "fc_norm."}.get(flag)
    if extra:
        state = load_file(str(off / "model.safetensors"))
        save_file({k: v for k, v in state.items() if extra not in k}, str(off / "model.safetensors"),
                  metadata={"format": "pt"})
    with_flag, without = draft_outputs(run.work / "draft", run.target)[0], draft_outputs(off, run.target)[0]
    assert (with_flag - without).abs().max() > 1e-3, flag


def test_a_broken_export_serves_away_from_the_offline_estimate(base, tmp_path):
    """The check above on a deliberately broken export: ``fc``'s input blocks of aux layers 2 and 5
    swapped (a wrong aux-layer order). vLLM serves it without complaint, but its served AL leaves
    the checkpoint's offline estimate and the equality check fails. Which way it moves is not the
    point: below on the machines measured before, above (1.60 vs 1.58) on a CPU with AMX, where this
    weakly trained draft happened to lose nothing by the swap."""
    run = _trained(base, tmp_path)
    broken = swap_fc_blocks(run.work / "draft", tmp_path / "broken")
    served, offline = served_and_offline(run, NO_LOSSLESS, draft=broken, out="eval_broken")
    s, o = served["overall"], offline["overall"]
    print(f"\nbroken export: served AL {s['acceptance_length']} / offline (checkpoint) {o['acceptance_length']}")
    assert o["acceptance_length"] >= AL_FLOOR
    assert abs(s["acceptance_length"] - o["acceptance_length"]) > 1e-3, (s, o)
    with pytest.raises(AssertionError):
        _same(served, offline)
