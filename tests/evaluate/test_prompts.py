"""Prompt-set loaders (published formats via ``datasets``) and the training-overlap exclusion."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.prompts import load_prompt_set, published


def test_heldout_excludes_training_overlap(prompts_store):
    groups, info = load_prompt_set(EvaluateConfig(), prompts_store)
    assert set(groups) == {"arithmetic", "prose"}
    ids = [p["sample_id"] for ps in groups.values() for p in ps]
    # Same question as a training prompt up to case/whitespace (and without its system prompt).
    assert "arithmetic-dup" not in ids and info["overlap_ids"] == ["arithmetic-dup"]
    assert info["loaded"] == 7 and info["overlap_excluded"] == 1 and len(ids) == 6
    kept, _ = load_prompt_set(EvaluateConfig(exclude_overlap=False), prompts_store)
    assert sum(map(len, kept.values())) == 7


def test_mt_bench_format(mt_bench_file, prompts_store):
    cfg = EvaluateConfig(prompt_set="mt_bench", prompt_path=str(mt_bench_file))
    groups, info = load_prompt_set(cfg, prompts_store)
    assert {g: [p["sample_id"] for p in ps] for g, ps in groups.items()} == {
        "math": ["mt_bench-2"], "writing": ["mt_bench-1"]}
    assert groups["math"][0]["messages"] == [{"role": "user", "content": "What is 3 + 4?"}]  # first turn
    assert info["overlap_ids"] == ["mt_bench-3"]


def test_speed_bench_format(speed_bench_dir, prompts_store):
    cfg = EvaluateConfig(prompt_set="speed_bench", prompt_path=str(speed_bench_dir), max_prompts_per_domain=1)
    groups, _ = load_prompt_set(cfg, prompts_store)
    assert {g: len(ps) for g, ps in groups.items()} == {"coding": 1, "rag": 1}
    assert published(str(speed_bench_dir / "qualitative"), name="s")["coding"][1]["messages"][0]["content"] \
        == "Reverse a list."


def test_errors(tmp_path, prompts_store):
    with pytest.raises(ConfigError, match="evaluate.prompt_path: required"):
        EvaluateConfig(prompt_set="mt_bench")
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=str(tmp_path / "nope.jsonl")),
                        prompts_store)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x"}\n')
    with pytest.raises(ConfigError, match="not the published mt_bench format"):
        load_prompt_set(EvaluateConfig(prompt_set="mt_bench", prompt_path=str(bad)), prompts_store)
    with pytest.raises(ConfigError, match="evaluate.context_buckets"):
        EvaluateConfig(context_buckets=(4,))
