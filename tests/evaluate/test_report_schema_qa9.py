"""QA pass 9: report.json rows keep one shape. A group (or bucket) whose every output ended at its prefill
token (``evaluate.max_tokens=1``, an early end token) has no draft round; its per-request fields were then a
subset (no median / min / max, no ``acceptance_histogram``), so a reader of report.json met a KeyError on
exactly the edge rows."""

from __future__ import annotations

import pytest

from eaglenest.evaluate.al import per_request_summary


def _metrics(hist):
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    m = RequestSpecDecodeMetrics.new(len(hist) - 1)
    for j, count in enumerate(hist):
        for _ in range(count):
            m.observe(len(hist) - 1, j)
    return m


@pytest.mark.parametrize("metrics", [[], [None], "no rounds"])
def test_a_row_without_draft_rounds_has_the_keys_of_a_row_with_them(metrics):
    if metrics == "no rounds":
        metrics = [_metrics([0, 0, 0, 0])]  # a request that ended at its prefill token
    measured = per_request_summary([_metrics([1, 2, 0, 1])])
    empty = per_request_summary(metrics)
    assert set(empty) == set(measured)
    assert empty["requests_with_drafts"] == 0 and empty["acceptance_histogram"] == []
    assert all(empty[k] is None for k in measured if k.startswith("acceptance_length"))

