"""95% intervals per context bucket (``evaluate.intervals``), the "not a measurement" flag, and
how both reach report.md and the error bars of ``al_by_context.png``."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from eaglenest.evaluate.intervals import add_intervals, bootstrap, bucket_intervals, percentile, ratio_stat


def _mean_ci(values, *, seed=0, resamples=2000):
    return bootstrap(len(values), ratio_stat(values, [1.0] * len(values)), resamples=resamples, seed=seed)


def _sample(n, seed=0):
    rng = random.Random(seed)
    return [rng.gauss(2.0, 0.5) for _ in range(n)]


def test_percentile_interpolates():
    assert percentile([0.0, 1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile([0.0, 1.0, 2.0, 3.0, 4.0], 0.25) == 1.0
    assert percentile([0.0, 10.0], 0.975) == pytest.approx(9.75)


def test_interval_contains_mean_and_has_the_expected_width():
    values = _sample(100)
    lo, hi = _mean_ci(values)
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    assert lo < mean < hi
    # Known data: the bootstrap of a mean matches the normal interval mean +- 1.96 sd / sqrt(n).
    assert hi - lo == pytest.approx(2 * 1.96 * sd / 100 ** 0.5, rel=0.2)
    assert _mean_ci([1.5] * 16) == (1.5, 1.5)  # no spread, no width


def test_interval_shrinks_with_more_prompts():
    few, many = _mean_ci(_sample(16)), _mean_ci(_sample(256))
    assert (many[1] - many[0]) < 0.5 * (few[1] - few[0])  # ~1/4: width goes as 1/sqrt(n)


def test_deterministic_per_seed():
    values = _sample(20)
    assert _mean_ci(values, seed=3) == _mean_ci(values, seed=3)
    assert _mean_ci(values, seed=3) != _mean_ci(values, seed=4)


def test_ratio_of_sums_resamples_prompts():
    """Pooled AL = 1 + accepted / rounds: a prompt with many rounds weighs more, as in vLLM's counters."""
    rows = [{"accepted_tokens": a, "draft_rounds": r} for a, r in [(30, 10), (0, 40), (12, 12), (5, 10)] * 4]
    ci = bucket_intervals(rows, resamples=500, seed=0)["acceptance_length"]
    pooled = 1 + sum(r["accepted_tokens"] for r in rows) / sum(r["draft_rounds"] for r in rows)
    assert ci[0] < pooled < ci[1] and 1.0 <= ci[0] and ci[1] <= 4.0
    assert set(bucket_intervals(rows, resamples=500, seed=0)) == {"acceptance_length"}  # only what rows carry


def _bucket(n, seed):
    rng = random.Random(seed)
    per = []
    for i in range(n):
        rounds = rng.randint(5, 30)
        per.append({"sample_id": f"p{i}", "material": "records", "evidence_distance_tokens": 900,
                    "answer_found": i % 2 == 0, "draft_rounds": rounds, "accepted_tokens": rng.randint(0, rounds),
                    "ngram_rounds": rounds, "ngram_accepted": rng.randint(0, rounds),
                    "confidence_sum": 8 * rng.uniform(0.5, 0.9), "confidence_tokens": 8,
                    "far_kept_sum": 4 * rng.uniform(0.7, 0.9), "far_removed_sum": 4 * rng.uniform(0.2, 0.5),
                    "far_tokens": 4})
    pooled = lambda a, b: round(sum(p[a] for p in per) / sum(p[b] for p in per), 4)  # noqa: E731
    return {"prompts": n, "prompt_tokens": 1024, "acceptance_length": 1 + pooled("accepted_tokens", "draft_rounds"),
            "acceptance_length_per_request": 1.5, "acceptance_rate": 0.2, "acceptance_by_position": [0.3],
            "ngram_al": 1 + pooled("ngram_accepted", "ngram_rounds"),
            "target_confidence": pooled("confidence_sum", "confidence_tokens"),
            "far_context": {"keep_tokens": 512, "probe_tokens": 4, "prompts": n,
                            "confidence_kept": pooled("far_kept_sum", "far_tokens"),
                            "confidence_far_removed": pooled("far_removed_sum", "far_tokens"),
                            "ratio": 0.5, "difference": 0.4},
            "per_prompt": per}


@pytest.fixture()
def report():
    return {"target": "t", "draft": "d", "split": "heldout", "temperature": 0.0, "num_speculative_tokens": 1,
            "al_average": "pooled", "bucket_max_tokens": 16,
            "domains": {"a": {"prompts": 1, "acceptance_length": 1.5, "acceptance_rate": 0.1,
                              "acceptance_by_position": [0.1]}},
            "overall": {"prompts": 1, "acceptance_length": 1.5, "acceptance_rate": 0.1,
                        "acceptance_by_position": [0.1]},
            "context_buckets": {"2048": _bucket(3, 1), "1024": _bucket(16, 2)},
            "predictability": {"measure": "m", "ngram": {"measure": "n"}, "far_context": "probe measure"}}


def test_add_intervals_flags_buckets_with_fewer_than_16_prompts(report):
    add_intervals(report, resamples=300, seed=0)
    small, full = report["context_buckets"]["2048"], report["context_buckets"]["1024"]
    assert small["measurement"] is False and small["note"] == "not a measurement: 3 prompt(s) < 16"
    assert full["measurement"] is True and "note" not in full
    for row in (small, full):
        ivals = row["intervals"]
        ratio = {"al_ratio_to_shortest"} if row is small else set()  # against 1024, the shortest
        assert set(ivals) == {"acceptance_length", "ngram_al", "target_confidence", "far_context_kept",
                              "far_context_removed", "far_context_difference"} | ratio
        for key in ("acceptance_length", "ngram_al", "target_confidence"):
            assert ivals[key][0] <= row[key] <= ivals[key][1], key
        assert ivals["far_context_difference"][0] > 0  # kept is always above removed in this data
    assert report["bucket_intervals"]["prompts_per_bucket"] == {"2048": 3, "1024": 16}
    assert report["bucket_intervals"]["resamples"] == 300 and report["bucket_intervals"]["level"] == 0.95


def _paired(n, seed, shift):
    """A bucket whose prompt i is prompt i of another with ``shift`` more accepted tokens per round share."""
    rng = random.Random(seed)
    per = []
    for i in range(n):
        rounds = 10 + 20 * (i % 4)  # prompts differ a lot between them ...
        acc = round(rounds * (0.2 + 0.5 * (i % 4) / 3 + shift))  # ... and little between buckets
        per.append({"sample_id": f"p{i}", "pair": i, "draft_rounds": rounds,
                    "accepted_tokens": acc + rng.randint(0, 1)})
    return {"prompts": n, "acceptance_length": 1 + sum(p["accepted_tokens"] for p in per) / sum(p["draft_rounds"]
                                                                                              for p in per),
            "per_prompt": per}


def test_ratio_to_the_shortest_bucket_pairs_prompts():
    report = {"context_buckets": {"2048": _paired(16, 1, -0.05), "1024": _paired(16, 2, 0.0),
                                  "4096": _paired(16, 3, 0.0)}}
    add_intervals(report, resamples=1000, seed=0)
    b = report["context_buckets"]
    assert "al_ratio_to_shortest" not in b["1024"] and report["bucket_intervals"]["ratio_to_shortest"] == {
        "bucket": "1024", "paired": True, "method": "the same prompt indices drawn for both buckets (paired prompts)"}
    for key in ("2048", "4096"):
        assert b[key]["al_ratio_to_shortest"] == round(b[key]["acceptance_length"] / b["1024"]["acceptance_length"], 4)
        lo, hi = b[key]["intervals"]["al_ratio_to_shortest"]
        assert lo <= b[key]["al_ratio_to_shortest"] <= hi
    # Paired draws cancel the spread between prompts: the 2048 bucket is below 1024's for sure, 4096 is not.
    assert b["2048"]["intervals"]["al_ratio_to_shortest"][1] < 1.0
    assert b["4096"]["intervals"]["al_ratio_to_shortest"][0] <= 1.0 <= b["4096"]["intervals"]["al_ratio_to_shortest"][1]
    paired_width = hi - lo
    # Without pairs (old reports, unequal counts) each bucket is drawn on its own: a wider interval.
    for row in b.values():
        for p in row["per_prompt"]:
            p.pop("pair")
    add_intervals(report, resamples=1000, seed=0)
    lo, hi = b["4096"]["intervals"]["al_ratio_to_shortest"]
    assert report["bucket_intervals"]["ratio_to_shortest"]["paired"] is False and hi - lo > 3 * paired_width


def test_report_and_plot_show_intervals_and_the_flag(report, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from eaglenest.evaluate.plots import context_axes
    from eaglenest.evaluate.report import markdown, write_report

    add_intervals(report, resamples=300, seed=0)
    pngs = write_report(tmp_path, report)
    assert (tmp_path / "al_by_context.png") in pngs and (tmp_path / "al_by_context.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["context_buckets"]["1024"]["intervals"]["acceptance_length"]
    md = markdown(saved)
    assert "Prompts per bucket: 3, 16" in md and "not a measurement: 3 prompt(s) < 16" in md
    lo, hi = saved["context_buckets"]["1024"]["intervals"]["acceptance_length"]
    al = saved["context_buckets"]["1024"]["acceptance_length"]
    assert f"| 1024 | 1024 | 16 | {al:.3f} [{lo:.3f}, {hi:.3f}] | - |" in md
    r_lo, r_hi = saved["context_buckets"]["2048"]["intervals"]["al_ratio_to_shortest"]
    assert f"| {saved['context_buckets']['2048']['al_ratio_to_shortest']:.3f} [{r_lo:.3f}, {r_hi:.3f}] |" in md
    assert "**AL / 1024**" in md and "drawn independently" in md  # 3 prompts against 16: not paired
    assert md.index("| 1024 | 1024 |") < md.index("| 2048 | 1024 |")
    assert "How much the target uses far context" in md and "| 1024 | 16 |" in md

    # The error bars: one errorbar container per series with intervals, bar ends at the interval.
    fig, ax = plt.subplots()
    right = context_axes(ax, dict(sorted(saved["context_buckets"].items(), key=lambda kv: int(kv[0]))))
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert [c.get_label() for c in bars] == ["pooled over rounds", "n-gram drafter (ngram_al)"]
    (segments,) = [lc.get_segments() for lc in bars[0].lines[2]]
    ends = [(round(float(s[0][1]), 3), round(float(s[1][1]), 3)) for s in segments]
    expect = [tuple(round(x, 3) for x in saved["context_buckets"][b]["intervals"]["acceptance_length"])
              for b in ("1024", "2048")]
    assert ends == expect
    assert any(isinstance(c, ErrorbarContainer) and c.has_yerr for c in right.containers)  # target_confidence
    assert "not a measurement" in ax.get_title()
    plt.close(fig)


def test_ngram_counts_per_bucket_prompt_pool_to_the_bucket_figure(tmp_path):
    """``ngram_al`` of a bucket from a real features table; its per-prompt counts (what the interval
    resamples) add up to the bucket's figure."""
    import sys
    from pathlib import Path

    import pyarrow as pa

    sys.path.insert(0, str(Path(__file__).parents[1] / "featurestore"))
    import fs_helpers as H

    from eaglenest.evaluate.config import EvaluateConfig
    from eaglenest.evaluate.run import ngram_predictability
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    m = H.meta()
    rows = H.rows(["a"], m, num_tokens=11)
    rows[0].update(input_ids=[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 8], loss_mask=[0] + [1] * 10)
    store.append(str(tmp_path), "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    report = {"domains": {"g": {}}, "overall": {},
              "context_buckets": {"64": {"prompts": 2, "per_prompt": [{"sample_id": "p0"}, {"sample_id": "p1"}]}}}
    outputs = {"g0": [5, 6, 7, 5], "p0": [5, 6, 7, 5, 6, 7, 8], "p1": [6, 7, 5, 9, 9]}
    prompt_ids = {"g0": [1], "p0": [1, 5], "p1": [1]}
    cfg = EvaluateConfig(num_speculative_tokens=2, ngram_order=2)
    ngram_predictability(report, {"g": [{"sample_id": "g0"}]}, {64: [{"sample_id": "p0"}, {"sample_id": "p1"}]},
                         outputs, prompt_ids, cfg, store_uri=str(tmp_path), table="features")
    bucket = report["context_buckets"]["64"]
    per = bucket["per_prompt"]
    assert all(p["ngram_rounds"] > 0 for p in per)
    assert bucket["ngram_al"] == pytest.approx(1 + sum(p["ngram_accepted"] for p in per)
                                               / sum(p["ngram_rounds"] for p in per), abs=1e-4)
    add_intervals(report, resamples=200, seed=0)
    lo, hi = bucket["intervals"]["ngram_al"]
    assert lo <= bucket["ngram_al"] <= hi
