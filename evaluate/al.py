"""Acceptance length (AL) measured from vLLM's own speculative-decoding counters.

vLLM counts, per engine, the number of draft rounds (``spec_decode_num_drafts``), the draft tokens
proposed and accepted, and accepted tokens per position. We decode one domain at a time and take
counter deltas, so every figure comes from the engine itself, not from our own re-computation.

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

import dataclasses
import logging

log = logging.getLogger(__name__)

PREFIX = "vllm:spec_decode_"


@dataclasses.dataclass(frozen=True)
class SpecCounters:
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = list(self.accepted_per_pos) + [0] * (n - len(self.accepted_per_pos))
        b = list(other.accepted_per_pos) + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(x - y for x, y in zip(a, b)))

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self - SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted,
                                   tuple(-x for x in other.accepted_per_pos))

    def summary(self) -> dict:
        drafts = max(self.drafts, 1)
        return {
            "acceptance_length": round(1.0 + self.accepted / drafts, 4) if self.drafts else None,
            "draft_rounds": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / self.draft_tokens, 4) if self.draft_tokens else None,
            # Share of rounds whose k-th draft token was accepted (k = 1..num_speculative_tokens); none
            # without rounds (every output ended at its prefill token), as for acceptance_length.
            "acceptance_by_position": [round(x / drafts, 4) for x in self.accepted_per_pos] if self.drafts else [],
        }


def read_counters(llm) -> SpecCounters:
    """Current totals of vLLM's spec-decode counters (summed over engines/labels)."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        key = m.name[len(PREFIX):]
        if key in totals:
            totals[key] += int(m.value)
        elif key == "num_accepted_tokens_per_pos":
            vals = list(m.values)
            per_pos = [a + b for a, b in zip(per_pos, vals)] if per_pos else vals
    return SpecCounters(totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"],
                        tuple(per_pos))


def _hist_al(hist) -> tuple[int, int]:
    """(rounds, accepted draft tokens) of a histogram indexed by accepted count."""
    return sum(hist), sum(j * c for j, c in enumerate(hist))


def per_request_summary(metrics: list) -> dict:
    """Both averages from vLLM ``RequestSpecDecodeMetrics`` objects (None entries are skipped)."""
    hists = [list(m.histogram) for m in metrics if m is not None and sum(m.histogram) > 0]
    if not hists:
        return {"requests_with_drafts": 0, "acceptance_length_per_request": None,
                "acceptance_by_position_per_request": [], "acceptance_length_from_histograms": None}
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
