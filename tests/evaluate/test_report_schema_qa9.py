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
    assert empty["acceptance_by_position_per_request"] == []
    assert all(empty[k] is None for k in measured if k.startswith("acceptance_length"))


def test_a_row_with_draft_rounds_has_its_figures_from_the_histograms():
    """The measured side of the comparison above, by hand: histogram [rounds accepting 0, 1, 2, 3 tokens]."""
    one, two = [1, 2, 0, 1], [0, 0, 3, 1]  # 4 rounds, 5 accepted: AL 2.25; 4 rounds, 9 accepted: AL 3.25
    row = per_request_summary([_metrics(one), None, _metrics([0, 0, 0, 0]), _metrics(two)])
    assert row["requests_with_drafts"] == 2 and row["acceptance_histogram"] == [1, 2, 3, 2]
    assert row["acceptance_length_per_request"] == pytest.approx((2.25 + 3.25) / 2)
    assert row["acceptance_length_per_request_median"] == pytest.approx(2.75)
    assert (row["acceptance_length_per_request_min"], row["acceptance_length_per_request_max"]) == (2.25, 3.25)
    assert row["acceptance_length_from_histograms"] == pytest.approx(1 + 14 / 8)
    # P(position j accepted) per request = rounds accepting at least j / rounds, then averaged over requests
    assert row["acceptance_by_position_per_request"] == pytest.approx([(3 / 4 + 4 / 4) / 2, (1 / 4 + 4 / 4) / 2,
                                                                       (1 / 4 + 1 / 4) / 2])

