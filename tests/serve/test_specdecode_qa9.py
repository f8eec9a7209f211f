"""One reader of vLLM's spec-decode counters (QA9): ``serve/draft_check.spec_metrics`` and
``evaluate/al.read_counters`` each parsed ``LLM.get_metrics()`` on their own (two copies that had already
drifted: the load check summed the engines' series, evaluate kept the shortest per-position vector).
Both now read through ``eaglenest.specdecode``. Several engines cannot run on this machine:
``EngineMetrics`` is a stub of ``LLM.get_metrics`` built from vLLM's own metric classes (named so).
"""

from __future__ import annotations

from vllm.v1.metrics.reader import Counter, Gauge, Vector

from eaglenest import specdecode
from eaglenest.evaluate import al
from eaglenest.serve import draft_check


class EngineMetrics:
    """Stub of an ``LLM`` whose ``get_metrics`` holds one series per engine (not a real engine)."""

    def __init__(self, per_engine: list[tuple[int, int, int, list[int]]]):
        self.per_engine = per_engine

    def get_metrics(self):
        out = []
        for i, (drafts, tokens, accepted, per_pos) in enumerate(self.per_engine):
            labels = {"engine": str(i), "model_name": "m"}
            out += [Counter("vllm:spec_decode_num_drafts", labels, drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", labels, tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, per_pos),
                    Gauge("vllm:num_requests_running", labels, 1.0)]
        return out


def test_serve_and_evaluate_read_the_counters_with_one_reader():
    assert al.read_counters is specdecode.read_counters and al.SpecCounters is specdecode.SpecCounters
    assert draft_check.read_counters is specdecode.read_counters
    llm = EngineMetrics([(10, 30, 20, [9, 7, 4]), (30, 90, 6, [5, 1, 0])])
    c = al.read_counters(llm)
    got = draft_check.spec_metrics(llm)
    assert (got["spec_decode_num_drafts"], got["spec_decode_num_draft_tokens"],
            got["spec_decode_num_accepted_tokens"]) == (c.drafts, c.draft_tokens, c.accepted) == (40, 120, 26)
    assert got["acceptance_length"] == c.acceptance_length == 1 + 26 / 40
    assert c.accepted_per_pos == (14, 8, 4)


def test_a_position_only_one_engine_reports_is_kept():
    """Engines whose per-position vectors differ in length (one drafted fewer tokens a round): every
    position is summed, none dropped (the shorter vector's missing positions count 0)."""
    c = specdecode.read_counters(EngineMetrics([(4, 8, 3, [2, 1]), (4, 12, 5, [3, 1, 1])]))
    assert c.accepted_per_pos == (5, 2, 1)
    assert sum(c.accepted_per_pos) == c.accepted
    assert c.summary()["acceptance_by_position"] == [round(5 / 8, 4), 0.25, 0.125]


def test_no_speculation_reads_zero_and_al_one_for_the_check():
    c = specdecode.read_counters(EngineMetrics([]))
    assert c == specdecode.SpecCounters(0, 0, 0, ()) and c.acceptance_length is None
    assert c.summary()["acceptance_length"] is None
    assert draft_check.spec_metrics(EngineMetrics([]))["acceptance_length"] == 1.0
