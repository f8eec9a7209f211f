"""Served-AL checkpoint selection with real vLLM on CPU, and the run report (JSON + PNG).

Features: greedy continuations of the committed tiny target (HF, in-process); held-out prompts:
a few chat prompts in the store's prompts table. Two evaluations (two engine starts, ~1 min).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.pipeline.served_al import served_al_scorer
from eaglenest.train.config import SelectConfig, TrainConfig
from eaglenest.train.loop import train

ROOT_TARGET = Path(__file__).resolve().parents[2] / "assets" / "tiny-target"


@pytest.fixture(scope="module")
def real_store(tmp_path_factory, synth):
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    uri = str(tmp_path_factory.mktemp("selstore") / "store")
    samples = synth.greedy_sequences(ROOT_TARGET, n=16, prompt_len=8, gen_len=40)
    synth.write_features(uri, ROOT_TARGET, samples)
    rows = [dict(sample_id=f"h{i}", domain="d", source="test", split="heldout", mode="chat",
                 messages_json=json.dumps([{"role": "user", "content": t}]), prompt_token_ids=[],
                 response_token_ids=[], finish_reason="", gen_params_id="g")
            for i, t in enumerate(["What is 2 + 2?", "Write about rain.", "Name a colour."])]
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return uri


@pytest.mark.slow
def test_served_al_selection_and_report(tmp_path, real_store):
    cfg = TrainConfig(draft_vocab_size=512, ttt_steps=3, pack_tokens=192, batch_rows=2, lr=5e-3,
                      warmup_steps=2, num_epochs=8, num_steps=8, log_every_steps=2,
                      select=SelectConfig(every_steps=4, prompts_per_domain=2))
    ev = EvaluateConfig(max_tokens=24, engine=EngineConfig(max_model_len=512, memory_fraction=0.1, max_num_seqs=4))
    score = served_al_scorer(cfg, ev, target_dir=str(ROOT_TARGET), store_uri=real_store)
    s = train(cfg, store_uri=real_store, workdir=str(tmp_path), target_dir=str(ROOT_TARGET), seed=0, score=score)
    out = s.outdir
    sel = [json.loads(x) for x in (out / "selection.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sel] == [4, 8]
    assert all(r["served_al"] >= 1.0 and r["prompts"] == 2 for r in sel)
    best = max(sel, key=lambda r: (r["served_al"], -r["step"]))
    info = json.loads((out / "checkpoint.json").read_text())
    assert info["selection"]["best_step"] == best["step"] == info["step"]
    assert info["selection"]["best_served_al"] == best["served_al"]
    # The run's checkpoint holds the best snapshot's weights.
    a, b = load_file(out / "draft.safetensors"), load_file(out / "best" / "draft.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    report = json.loads((out / "report.json").read_text())
    assert [r["step"] for r in report["served_al"]] == [4, 8] and len(report["metrics"]) == 4
    assert len(report["metrics"][0]["step_acc"]) == 3 and 0 <= report["stall_fraction"] < 1
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The served ALs are in the TensorBoard event files too (docs/trackers.md), at their steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("select/served_al")] == \
        [(r["step"], pytest.approx(r["served_al"], rel=1e-6)) for r in sel]


def test_selection_without_a_scorer_is_a_config_error(tmp_path, real_store):
    """The trainer does not serve drafts itself (that needs later stages): a direct call asking for
    selection without ``score=`` stops before training, naming what to pass."""
    cfg = TrainConfig(draft_vocab_size=512, ttt_steps=2, pack_tokens=192, batch_rows=2, num_steps=2,
                      select=SelectConfig(every_steps=1))
    with pytest.raises(ConfigError, match="score="):
        train(cfg, store_uri=real_store, workdir=str(tmp_path), target_dir=str(ROOT_TARGET), seed=0)
    assert not (tmp_path / "train" / "checkpoint.json").exists()


def test_selection_serves_only_what_the_score_uses():
    """A selection round keeps the recipe's engine and decoding settings, but not the checks and the
    long-context buckets (1K-32K by default) that only ``evaluate al`` reports."""
    from eaglenest.pipeline.served_al import selection_config

    ev = EvaluateConfig(max_tokens=24, engine=EngineConfig(max_model_len=512, memory_fraction=0.1))
    assert ev.context_buckets and ev.check_lossless and ev.ngram_order > 0
    cfg = selection_config(TrainConfig(select=SelectConfig(prompts_per_domain=3, split="heldout")), ev)
    assert cfg.context_buckets == () and not cfg.check_lossless and cfg.ngram_order == 0
    assert cfg.split == "heldout" and cfg.max_prompts_per_domain == 3
    assert cfg.engine == ev.engine and cfg.max_tokens == 24
    assert selection_config(TrainConfig()).context_buckets == ()

