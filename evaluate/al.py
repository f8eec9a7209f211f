"""Acceptance length (AL) measured from vLLM's own speculative-decoding counters.

vLLM counts, per engine, the number of draft rounds (``spec_decode_num_drafts``), the draft tokens
proposed and accepted, and accepted tokens per position. We decode one domain at a time and take
counter deltas, so every figure comes from the engine itself, not from our own re-computation
(``eaglenest.specdecode`` reads the counters, for ``serve``'s load check too).

Two averages are reported, both from vLLM:

* ``acceptance_length`` is **pooled over draft rounds**: ``1 + accepted / drafts`` summed over all
  requests of the group (each round emits the accepted tokens plus one token from the target), so
  requests with more rounds weigh more. Taken from the engine's counters (deltas per group).
* ``acceptance_length_per_request`` is the **mean over requests** of each request's own AL, from
  vLLM's per-request spec-decode metrics (``per_request_spec_decode_metrics="summary"``: a histogram
  of accepted draft tokens per round). Short requests weigh as much as long ones.

Per-position acceptance (share of rounds whose k-th draft token was accepted) is given both ways
too. The pooled figures computed from the per-request histograms must equal the counter deltas;
the report carries both so a mismatch is visible.
"""

from __future__ import annotations

import logging

from eaglenest.specdecode import SpecCounters, read_counters  # the readers' home; kept here for callers of before

__all__ = ["SpecCounters", "per_request_summary", "read_counters"]

log = logging.getLogger(__name__)


def _hist_al(hist) -> tuple[int, int]:
    """(rounds, accepted draft tokens) of a histogram indexed by accepted count."""
    return sum(hist), sum(j * c for j, c in enumerate(hist))


def per_request_summary(metrics: list) -> dict:
    """Both averages from vLLM ``RequestSpecDecodeMetrics`` objects (None entries are skipped)."""
    hists = [list(m.histogram) for m in metrics if m is not None and sum(m.histogram) > 0]
    if not hists:  # no draft round (every output ended at its prefill token): the same keys, no figures
        return {"requests_with_drafts": 0, "acceptance_length_per_request": None,
                "acceptance_length_per_request_median": None, "acceptance_length_per_request_min": None,
                "acceptance_length_per_request_max": None, "acceptance_by_position_per_request": [],
                "acceptance_length_from_histograms": None, "acceptance_histogram": []}
    k = max(len(h) for h in hists) - 1
    hists = [h + [0] * (k + 1 - len(h)) for h in hists]
    als, pos_req = [], []
    for h in hists:
        rounds, acc = _hist_al(h)
        als.append(1.0 + acc / rounds)
        # P(k-th draft token accepted) = rounds with at least k accepted / rounds.
        pos_req.append([sum(h[j:]) / rounds for j in range(1, k + 1)])
    pooled = [sum(col) for col in zip(*hists)]
    rounds, acc = _hist_al(pooled)
    srt = sorted(als)
    return {
        "requests_with_drafts": len(hists),
        "acceptance_length_per_request": round(sum(als) / len(als), 4),
        "acceptance_length_per_request_median": round(srt[len(srt) // 2] if len(srt) % 2
                                                      else (srt[len(srt) // 2 - 1] + srt[len(srt) // 2]) / 2, 4),
        "acceptance_length_per_request_min": round(srt[0], 4),
        "acceptance_length_per_request_max": round(srt[-1], 4),
        "acceptance_by_position_per_request": [round(sum(c) / len(c), 4) for c in zip(*pos_req)],
        "acceptance_length_from_histograms": round(1.0 + acc / rounds, 4),
        "acceptance_histogram": pooled,
    }
