"""vLLM's speculative-decoding counters, read from ``LLM.get_metrics()``: the one reader every stage uses.

vLLM counts, per engine (one series per engine core: data parallel, several cores, labelled
``engine="0"``, ``engine="1"``), the draft rounds (``spec_decode_num_drafts``), the draft tokens proposed
and accepted, and the accepted tokens per draft position (a :class:`vllm.v1.metrics.reader.Vector`).
:func:`read_counters` sums every series into one :class:`SpecCounters`; ``serve``'s load check and
``evaluate``'s AL both read through it (stages 4 and 5, so the reader sits below both). Trade-off: the
totals since the engine started, so a measurement of one group is a difference of two reads
(``after - before``).
"""

from __future__ import annotations

import dataclasses

PREFIX = "vllm:spec_decode_"


@dataclasses.dataclass(frozen=True)
class SpecCounters:
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        a, b = _padded(self.accepted_per_pos, other.accepted_per_pos)
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(x - y for x, y in zip(a, b)))

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        return self - SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted,
                                   tuple(-x for x in other.accepted_per_pos))

    @property
    def acceptance_length(self) -> float | None:
        """``1 + accepted / drafts`` (pooled over draft rounds); None without a round."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def summary(self) -> dict:
        drafts = max(self.drafts, 1)
        return {
            "acceptance_length": round(self.acceptance_length, 4) if self.drafts else None,
            "draft_rounds": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / self.draft_tokens, 4) if self.draft_tokens else None,
            # Share of rounds whose k-th draft token was accepted (k = 1..num_speculative_tokens); none
            # without rounds (every output ended at its prefill token), as for acceptance_length.
            "acceptance_by_position": [round(x / drafts, 4) for x in self.accepted_per_pos] if self.drafts else [],
        }


def _padded(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> tuple[list[int], list[int]]:
    """``a`` and ``b`` with zeros after the shorter one, so a position one of them lacks is not dropped."""
    n = max(len(a), len(b))
    return list(a) + [0] * (n - len(a)), list(b) + [0] * (n - len(b))


def read_counters(llm) -> SpecCounters:
    """Current totals of vLLM's spec-decode counters of ``llm`` (a ``vllm.LLM``), summed over its engines'
    series; an engine without speculation has none: all zero."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[int] = []
    for m in llm.get_metrics():
        if not m.name.startswith(PREFIX):
            continue
        key = m.name[len(PREFIX):]
        if key in totals:
            totals[key] += int(m.value)
        elif key == "num_accepted_tokens_per_pos":
            a, b = _padded(per_pos, [int(v) for v in m.values])
            per_pos = [x + y for x, y in zip(a, b)]
    return SpecCounters(totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"],
                        tuple(per_pos))
