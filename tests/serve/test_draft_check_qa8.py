"""``serve/draft_check.spec_metrics`` with several engines reporting (QA8): vLLM labels each engine's
spec-decode counters (``engine="0"``, ``engine="1"``: data parallel, several engine cores), and before the
fix the check kept the last series only, so its AL was one engine's. Two engines cannot run on this
machine: ``TwoEngineMetrics`` is a stub of ``LLM.get_metrics`` (vLLM's own metric classes, two series).
"""

from __future__ import annotations

from vllm.v1.metrics.reader import Counter, Gauge, Vector

from eaglenest.serve.draft_check import spec_metrics


class TwoEngineMetrics:
    """Stub of an ``LLM`` whose ``get_metrics`` holds two engines' series (named so: not a real engine)."""

    def __init__(self, per_engine: list[tuple[int, int, int]]):
        self.per_engine = per_engine

    def get_metrics(self):
        out = []
        for i, (drafts, tokens, accepted) in enumerate(self.per_engine):
            labels = {"engine": str(i), "model_name": "m"}
            out += [Counter("vllm:spec_decode_num_drafts", labels, drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", labels, tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, [accepted, 0, 0]),
                    Gauge("vllm:num_requests_running", labels, 0.0)]
        return out


def test_counters_of_every_engine_are_summed():
    got = spec_metrics(TwoEngineMetrics([(10, 30, 20), (30, 90, 0)]))
    assert got["spec_decode_num_drafts"] == 40 and got["spec_decode_num_draft_tokens"] == 120
    assert got["spec_decode_num_accepted_tokens"] == 20
    assert got["acceptance_length"] == 1 + 20 / 40  # pooled over both engines' rounds (was 1.0: engine 1's)


def test_one_engine_and_no_drafts():
    assert spec_metrics(TwoEngineMetrics([(4, 12, 6)]))["acceptance_length"] == 2.5
    assert spec_metrics(TwoEngineMetrics([]))["acceptance_length"] == 1.0
    assert spec_metrics(TwoEngineMetrics([(0, 0, 0), (0, 0, 0)]))["acceptance_length"] == 1.0
