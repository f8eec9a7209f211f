"""95% intervals per context bucket: a percentile bootstrap over the bucket's prompts.

Every figure of a bucket is a ratio of sums over its prompts: pooled AL is ``1 + accepted /
rounds``, ``ngram_al`` the same for the n-gram replay, ``target_confidence`` a sum of token
probabilities over a token count. Each bucket row keeps those sums per prompt (``per_prompt``); a
resample draws the bucket's prompts with replacement and recomputes the figure on the draw, and the
interval is the 2.5th and 97.5th percentiles of the recomputed figures. Prompts, not tokens or
draft rounds, are what is resampled: the tokens of one prompt are not independent draws, and a
bucket's claim is about prompts of its length.

Each longer bucket's AL is also put against the shortest bucket's (``al_ratio_to_shortest``, the
"flat from 1K to 32K" claim) with an interval of that ratio: bucket prompts are paired (prompt ``i``
asks the same question at every length, ``evaluate.buckets``), so a resample draws prompt indices
once and recomputes both buckets' AL on them, which cancels what the questions themselves
contribute; buckets that are not paired (different counts, rows without ``pair``) are resampled
independently (a wider interval).

Trade-off: a percentile interval from few prompts is too narrow, so a bucket with fewer than
``MIN_BUCKET_PROMPTS`` prompts is flagged "not a measurement" however narrow its interval looks; a
bucket of one prompt gets no interval at all (every resample is that prompt: zero width). Pure
Python and seeded: the same per-prompt figures and seed give the same interval on every machine.
"""

from __future__ import annotations

import random
from typing import Callable

from eaglenest.evaluate.config import MIN_BUCKET_PROMPTS

LEVEL = 0.95
METHOD = "percentile bootstrap over the bucket's prompts (resampled with replacement)"

#: figure -> (numerator, denominator, offset) of the per-prompt sums: figure = offset + sum(num) / sum(den).
FIGURES = {
    "acceptance_length": ("accepted_tokens", "draft_rounds", 1.0),
    "ngram_al": ("ngram_accepted", "ngram_rounds", 1.0),
    "target_confidence": ("confidence_sum", "confidence_tokens", 0.0),
    "far_context_kept": ("far_kept_sum", "far_tokens", 0.0),
    "far_context_removed": ("far_removed_sum", "far_tokens", 0.0),
}

Stat = Callable[[list[int]], "float | None"]


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted values, linear between neighbours."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap(n: int, stat: Stat, *, resamples: int, seed: int | str, level: float = LEVEL
              ) -> tuple[float, float] | None:
    """Percentile interval of ``stat`` over ``resamples`` draws of ``n`` indices with replacement.

    ``stat`` maps a list of indices to a figure (None when undefined on that draw, e.g. no draft
    rounds at all; such draws are left out). None when ``n`` is below 2 (every draw of one prompt is
    that prompt: its zero-width interval would read as certainty) or no draw is defined."""
    if n < 2:
        return None
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        v = stat([rng.randrange(n) for _ in range(n)])
        if v is not None:
            values.append(v)
    if not values:
        return None
    values.sort()
    tail = (1.0 - level) / 2
    return percentile(values, tail), percentile(values, 1.0 - tail)


def ratio_stat(num: list[float], den: list[float], offset: float = 0.0) -> Stat:
    """``offset + sum(num[i]) / sum(den[i])`` over the drawn indices (None on a zero denominator)."""
    def stat(idx: list[int]) -> float | None:
        d = sum(den[i] for i in idx)
        return offset + sum(num[i] for i in idx) / d if d else None

    return stat


def _column(rows: list[dict], key: str) -> list[float] | None:
    vals = [r.get(key) for r in rows]
    return None if not vals or any(v is None for v in vals) else vals


def bucket_intervals(rows: list[dict], *, resamples: int, seed: int | str, level: float = LEVEL) -> dict:
    """``{figure: [low, high]}`` for every figure all of ``rows`` (one bucket's prompts) carry, and
    ``far_context_difference`` (kept - removed, on the same draw: a paired interval), and
    ``answer_value_difference`` the same over the prompts whose reference answer was scored."""
    out: dict = {}
    for name, (nk, dk, offset) in FIGURES.items():
        num, den = _column(rows, nk), _column(rows, dk)
        if num is None or den is None or not sum(den):
            continue
        ci = bootstrap(len(rows), ratio_stat(num, den, offset), resamples=resamples, seed=f"{seed}:{name}", level=level)
        if ci is not None:
            out[name] = [round(ci[0], 4), round(ci[1], 4)]
    for name, keys, subset in (("far_context_difference", ("far_kept_sum", "far_removed_sum", "far_tokens"), rows),
                               ("answer_value_difference", ("answer_kept_sum", "answer_removed_sum", "answer_tokens"),
                                [r for r in rows if r.get("answer_tokens")])):
        ci = _paired_difference(subset, keys, resamples=resamples, seed=f"{seed}:{name}", level=level)
        if ci is not None:
            out[name] = ci
    return out


def _paired_difference(rows: list[dict], keys: tuple[str, str, str], *, resamples: int, seed: str,
                       level: float) -> list[float] | None:
    """Interval of kept - removed (``keys``: their sums and the token count) on the same draws."""
    kept, removed, toks = (_column(rows, k) for k in keys)
    if not (kept and removed and toks and sum(toks)):
        return None
    k, r = ratio_stat(kept, toks), ratio_stat(removed, toks)

    def diff(idx: list[int]) -> float | None:
        a, b = k(idx), r(idx)
        return None if a is None or b is None else a - b

    ci = bootstrap(len(rows), diff, resamples=resamples, seed=seed, level=level)
    return None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


def add_intervals(report: dict, *, resamples: int, seed: int, min_prompts: int = MIN_BUCKET_PROMPTS) -> dict:
    """Put ``intervals``, ``measurement`` (and, when false, ``note``) on every context bucket of
    ``report`` from its ``per_prompt`` rows; record how in ``report["bucket_intervals"]``."""
    counts = {}
    for bucket, row in (report.get("context_buckets") or {}).items():
        rows = row.get("per_prompt") or []
        counts[bucket] = row.get("prompts", len(rows))
        row["intervals"] = bucket_intervals(rows, resamples=resamples, seed=f"{seed}:{bucket}")
        row["measurement"] = counts[bucket] >= min_prompts
        if not row["measurement"]:
            row["note"] = f"not a measurement: {counts[bucket]} prompt(s) < {min_prompts}"
    report["bucket_intervals"] = {"level": LEVEL, "method": METHOD, "resamples": resamples, "seed": seed,
                                  "min_prompts": min_prompts, "prompts_per_bucket": counts}
    return add_ratio_intervals(report, resamples=resamples, seed=seed)


def add_ratio_intervals(report: dict, *, resamples: int, seed: int | str, level: float = LEVEL) -> dict:
    """Put ``al_ratio_to_shortest`` (pooled AL / the shortest bucket's) and its interval on every
    longer context bucket of ``report``; record how in ``report["bucket_intervals"]``."""
    buckets = sorted((report.get("context_buckets") or {}).items(), key=lambda kv: int(kv[0]))
    if len(buckets) < 2:
        return report
    (base_key, base), paired_all, ratios = buckets[0], True, 0
    keys = FIGURES["acceptance_length"]
    base_rows = base.get("per_prompt") or []
    by_pair = {r.get("pair"): r for r in base_rows}
    for key, row in buckets[1:]:
        rows = row.get("per_prompt") or []
        if not base.get("acceptance_length") or row.get("acceptance_length") is None:
            continue
        row["al_ratio_to_shortest"] = round(row["acceptance_length"] / base["acceptance_length"], 4)
        ratios += 1
        paired = (bool(rows) and len(rows) == len(base_rows) and len(by_pair) == len(base_rows)
                  and all(r.get("pair") is not None and r.get("pair") in by_pair for r in rows))
        paired_all &= paired
        first = [by_pair[r["pair"]] for r in rows] if paired else base_rows
        ci = _ratio_interval(first, rows, keys, paired=paired, resamples=resamples,
                             seed=f"{seed}:{key}:ratio", level=level)
        if ci is not None:
            row.setdefault("intervals", {})["al_ratio_to_shortest"] = ci
    if not ratios:  # no AL to divide (no draft rounds): say nothing of how ratios were drawn
        return report
    report.setdefault("bucket_intervals", {})["ratio_to_shortest"] = {
        "bucket": base_key, "paired": paired_all,
        "method": "the same prompt indices drawn for both buckets (paired prompts)" if paired_all
        else "each bucket's prompts drawn independently (prompts not paired)"}
    return report


def _ratio_interval(first: list[dict], rows: list[dict], keys: tuple[str, str, float], *, paired: bool,
                    resamples: int, seed: str, level: float) -> list[float] | None:
    """Interval of figure(rows) / figure(first): one index draw for both when ``paired``, else one each."""
    nk, dk, offset = keys
    cols = [(_column(r, nk), _column(r, dk)) for r in (first, rows)]
    if any(num is None or den is None or not sum(den) for num, den in cols):
        return None
    a, b = (ratio_stat(num, den, offset) for num, den in cols)
    rng = random.Random(f"{seed}:second")

    def ratio(idx: list[int]) -> float | None:
        other = idx if paired else [rng.randrange(len(rows)) for _ in range(len(rows))]
        x, y = a(idx), b(other)
        return None if not x or y is None else y / x

    ci = bootstrap(len(first), ratio, resamples=resamples, seed=seed, level=level)
    return None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


def spec_counts(metrics) -> dict:
    """Per-prompt draft rounds, accepted tokens and the histogram they come from (rounds by accepted
    count: the bucket's ``acceptance_histogram`` and ``acceptance_by_position`` pool them) from vLLM's
    per-request spec-decode metrics."""
    hist = [int(c) for c in getattr(metrics, "histogram", None) or []]
    return {"draft_rounds": sum(hist), "accepted_tokens": sum(j * c for j, c in enumerate(hist)),
            "acceptance_histogram": hist}


def per_prompt(report: dict, bucket, sample_id: str) -> dict:
    """The ``per_prompt`` row of ``sample_id`` in ``bucket`` (to add a measure's sums to)."""
    for row in report["context_buckets"][str(bucket)]["per_prompt"]:
        if row["sample_id"] == sample_id:
            return row
    raise KeyError(sample_id)
