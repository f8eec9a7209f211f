"""PNG plots of evaluation reports (matplotlib, Agg backend, imported lazily).

AL by domain, AL against context length, acceptance by draft position, and throughput against
concurrency. Each plot shows both averages where the report has them; files are written to a
temporary name and renamed, so a reader never sees half a PNG.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from eaglenest.evaluate.buckets import buckets_in_order

log = logging.getLogger(__name__)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=100, bbox_inches="tight")
    _plt().close(fig)
    os.replace(tmp, path)
    return path


def _bars(ax, names, rows):
    import numpy as np

    x = np.arange(len(names))
    pooled = [r.get("acceptance_length") or 0 for r in rows]
    per_req = [r.get("acceptance_length_per_request") or 0 for r in rows]
    ax.bar(x - 0.2, pooled, 0.4, label="pooled over rounds")
    ax.bar(x + 0.2, per_req, 0.4, label="mean per request")
    if any(r.get("ngram_al") for r in rows):  # the training-free n-gram drafter on the same outputs
        ax.scatter(x, [r.get("ngram_al") or float("nan") for r in rows], marker="_", s=400, color="black",
                   zorder=3, label="n-gram drafter (ngram_al)")
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_ylabel("acceptance length")
    ax.legend()


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
        xs = [int(b) for b in buckets]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for key, label in (("acceptance_length", "pooled over rounds"),
                           ("acceptance_length_per_request", "mean per request")):
            ax.plot(xs, [buckets[b].get(key) or 0 for b in buckets], marker="o", label=label)
        if any(buckets[b].get("ngram_al") for b in buckets):
            ax.plot(xs, [buckets[b].get("ngram_al") or float("nan") for b in buckets], ls="--", color="black",
                    label="n-gram drafter (ngram_al)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 else str(x) for x in xs])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("acceptance length")
        ax.set_title("AL against context length")
        ax.legend()
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
