"""PNG plots of evaluation reports (matplotlib, Agg backend, imported lazily).

AL by domain, AL against context length (95% intervals per bucket as error bars, see
``evaluate.intervals``), acceptance by draft position, and throughput against concurrency. Each plot shows both averages where the report has them; files are written to a
temporary name and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from eaglenest.evaluate.buckets import buckets_in_order
from eaglenest.evaluate.config import MIN_BUCKET_PROMPTS

log = logging.getLogger(__name__)

#: What :func:`al_plots` can write (``al_by_context.png`` only for a report with context buckets).
AL_PLOTS = ("al_by_domain.png", "al_by_context.png", "acceptance_by_position.png")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=100, bbox_inches="tight")
        os.replace(tmp, path)
    finally:  # interrupted or failed: no half-written temporary file left beside the plots
        _plt().close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _bars(ax, names, rows):
    import numpy as np

    x = np.arange(len(names))
    ax.bar(x - 0.2, _values(rows, "acceptance_length"), 0.4, label="pooled over rounds")  # no rounds: no bar
    ax.bar(x + 0.2, _values(rows, "acceptance_length_per_request"), 0.4, label="mean per request")
    if any(r.get("ngram_al") for r in rows):  # the training-free n-gram drafter on the same outputs
        ax.scatter(x, _values(rows, "ngram_al"), marker="_", s=400, color="black",
                   zorder=3, label="n-gram drafter (ngram_al)")
    ax.set_xticks(x, names, rotation=30, ha="right", parse_math=False)  # a category's "$" is text, not TeX
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("acceptance length")
    ax.legend()


def _yerr(rows: list[dict], key: str) -> list[list[float]] | None:
    """Matplotlib ``yerr`` (below, above) from each row's 95% interval of ``key``: no bar (0, 0) for a row
    without one (one prompt, no figure), so the other rows keep theirs; None when no row has one."""
    cis = [(r.get("intervals") or {}).get(key) if r.get(key) is not None else None for r in rows]
    if not any(cis):
        return None
    return [[max(0.0, r[key] - ci[0]) if ci else 0.0 for ci, r in zip(cis, rows)],
            [max(0.0, ci[1] - r[key]) if ci else 0.0 for ci, r in zip(cis, rows)]]


def _values(rows: list[dict], key: str) -> list[float]:
    """Each row's ``key``, NaN (no point) where it has none: a bucket without draft rounds has no AL, not 0."""
    return [float("nan") if r.get(key) is None else r[key] for r in rows]


def _prompt_tokens(bucket: str, row: dict) -> int:
    """Where a bucket sits on the prompt-tokens axis: its prompts' length (a bucket past the target's
    positions is shortened, ``evaluate.buckets``), the bucket's own name in a report without it."""
    return int(row.get("prompt_tokens") or bucket)


def _tokens_label(x: int) -> str:
    """``4K`` for whole multiples of 1024, ``3.9K`` for a shortened bucket's 4032, the count below 1024."""
    return str(x) if x < 1024 else f"{x // 1024}K" if x % 1024 == 0 else f"{x / 1024:.1f}K"


def context_axes(ax, buckets: dict[str, dict]):
    """AL (pooled, per request), ``ngram_al`` and, on a right axis, ``target_confidence`` against
    prompt length, with 95% intervals as error bars where the report has them; the title says when
    a bucket has too few prompts to be a measurement. Returns the right axis (or None)."""
    rows = [buckets[b] for b in buckets]
    xs = [_prompt_tokens(b, r) for b, r in zip(buckets, rows)]
    ax.errorbar(xs, _values(rows, "acceptance_length"), yerr=_yerr(rows, "acceptance_length"),
                marker="o", capsize=3, label="pooled over rounds")
    ax.plot(xs, _values(rows, "acceptance_length_per_request"), marker="o", label="mean per request")
    if any(r.get("ngram_al") for r in rows):
        ax.errorbar(xs, _values(rows, "ngram_al"), yerr=_yerr(rows, "ngram_al"), ls="--",
                    color="black", capsize=3, label="n-gram drafter (ngram_al)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [_tokens_label(x) for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("acceptance length")
    few = [(x, r) for x, r in zip(xs, rows) if r.get("measurement") is False]
    if few:  # ringed: too few prompts for the point (and its interval) to be a measurement
        ax.scatter([x for x, _ in few], _values([r for _, r in few], "acceptance_length"), s=160,
                   facecolors="none", edgecolors="red", zorder=4, label=f"< {MIN_BUCKET_PROMPTS} prompts")
    n = sorted({r.get("prompts") for r in rows})
    ax.set_title(f"AL against context length ({'/'.join(map(str, n))} prompts per bucket"
                 + (", 95% intervals)" if any(r.get("intervals") for r in rows) else ")")
                 + (f"\nfewer than {MIN_BUCKET_PROMPTS} prompts: not a measurement" if few else ""), fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    right = None
    if any(r.get("target_confidence") is not None for r in rows):
        right = ax.twinx()
        right.errorbar(xs, _values(rows, "target_confidence"), yerr=_yerr(rows, "target_confidence"), ls=":",
                       marker="s", color="grey", capsize=3, label="target_confidence (right)")
        right.set_ylim(0, 1.05)
        right.set_ylabel("target_confidence")
        h, lab = right.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    ax.legend(handles, labels, fontsize=7)
    return right


def al_plots(report: dict, outdir: Path) -> list[Path]:
    plt = _plt()
    out = []
    names = list(report["domains"])
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(names) + 2), 3.5))
    _bars(ax, names, [report["domains"][n] for n in names])
    ax.set_title(f"AL by group (k={report['num_speculative_tokens']})")
    out.append(_save(fig, outdir / "al_by_domain.png"))

    buckets = dict(buckets_in_order(report))
    if buckets:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        context_axes(ax, buckets)
        out.append(_save(fig, outdir / "al_by_context.png"))

    fig, ax = plt.subplots(figsize=(5, 3.5))
    series = [("overall", report["overall"])] + [(f"{b} tok", r) for b, r in buckets.items()]
    for name, r in series:
        pos = r.get("acceptance_by_position") or []
        ax.plot(range(1, len(pos) + 1), pos, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepted")
    ax.set_ylim(0, 1)
    ax.set_title("acceptance by position (pooled)")
    ax.legend(fontsize=7)
    out.append(_save(fig, outdir / "acceptance_by_position.png"))
    return out


def throughput_plot(result: dict, outdir: Path) -> Path:
    """Output tokens/s against concurrency, with and without speculation (mean +- spread of seeds)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mode, rows in result["modes"].items():
        xs = [r["concurrency"] for r in rows]
        ys = [r["output_tokens_per_s"]["mean"] for r in rows]
        lo = [r["output_tokens_per_s"]["mean"] - r["output_tokens_per_s"]["min"] for r in rows]
        hi = [r["output_tokens_per_s"]["max"] - r["output_tokens_per_s"]["mean"] for r in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput against concurrency")
    ax.legend()
    return _save(fig, Path(outdir) / "throughput.png")
