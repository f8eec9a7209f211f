"""Both averages from vLLM's per-request metrics objects, and exact-length context buckets."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eaglenest.evaluate.al import SpecCounters, per_request_summary
from eaglenest.evaluate.buckets import build_bucket_prompts


def _metrics(hist):
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    m = RequestSpecDecodeMetrics.new(3)
    for j, count in enumerate(hist):
        for _ in range(count):
            m.observe(3, j)
    return m


def test_pooled_and_per_request_averages():
    a, b = [0, 0, 0, 2], [4, 0, 0, 0]  # a: 2 rounds all accepted (AL 4); b: 4 rounds none (AL 1)
    s = per_request_summary([_metrics(a), _metrics(b), None])
    assert s["requests_with_drafts"] == 2
    assert s["acceptance_length_per_request"] == pytest.approx(2.5)  # (4 + 1) / 2
    assert s["acceptance_length_from_histograms"] == pytest.approx(1 + 6 / 6)  # pooled: 6 accepted / 6 rounds
    assert s["acceptance_by_position_per_request"] == [0.5, 0.5, 0.5]
    # The pooled histogram equals what the engine counters would give.
    counters = SpecCounters(drafts=6, draft_tokens=18, accepted=6, accepted_per_pos=(2, 2, 2))
    assert counters.summary()["acceptance_length"] == s["acceptance_length_from_histograms"]
    assert counters.summary()["acceptance_by_position"] == [round(2 / 6, 4)] * 3
    assert vars(_metrics(a))["histogram"] == a and _metrics(a).to_dict()["mean_acceptance_length"] == 4.0


def test_bucket_prompts_exact_length(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    material = [([{"role": "user", "content": f"Question {i}?"}], f"Answer number {i}.") for i in range(5)]
    out = build_bucket_prompts(tok, material, (64, 1024, 4096), per_bucket=2, max_positions=4096,
                               max_tokens=32, seed=0)
    assert [len(p["prompt_token_ids"]) for b in (64, 1024) for p in out[b]] == [64, 64, 1024, 1024]
    assert len(out[4096][0]["prompt_token_ids"]) == 4096 - 32  # shortened to fit the positions
    ids = out[1024][0]["prompt_token_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids).rstrip().endswith("<|assistant|>")  # ends where the answer starts
    assert out[1024][0]["prompt_token_ids"] != out[1024][1]["prompt_token_ids"]
    assert out[4096][0]["material_passes"] > 1  # short material is cycled, and the report says so


def test_spearman_ranks_with_ties():
    from eaglenest.evaluate.run import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    # ties take the average rank: ranks x = (0.5, 0.5, 2), y = (0, 1, 2)
    assert spearman([5, 5, 9], [1, 2, 3]) == pytest.approx(0.8660, abs=1e-4)


def test_markdown_orders_buckets_by_length_and_shows_ngram(tmp_path):
    """report.json stores bucket keys as sorted text ("16384" < "2048"); the report reads them back
    in numeric order, and puts ngram_al beside AL when the report has it."""
    import json

    from eaglenest.evaluate.report import markdown, write_report

    row = lambda al, ng: {"prompts": 1, "acceptance_length": al, "acceptance_rate": 0.1,  # noqa: E731
                          "acceptance_by_position": [0.1], "ngram_al": ng, "prompt_tokens": 1}
    report = {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 1,
              "al_average": "pooled", "domains": {"a": row(1.5, 1.2)}, "overall": row(1.5, 1.2),
              "context_buckets": {"2048": row(1.2, 1.1), "16384": row(1.1, 1.3)},
              "predictability": {"ngram": {"measure": "n-gram"}, "spearman_al_vs_ngram": None}}
    write_report(tmp_path, report, plots=False)
    md = markdown(json.loads((tmp_path / "report.json").read_text()))
    assert md.index("| 2048 |") < md.index("| 16384 |")
    assert "| ngram_al |" in md and "| a | 1.200 | 1 | 1.500 |" in md
