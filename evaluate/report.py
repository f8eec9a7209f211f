"""Write an evaluation report: ``report.json``, a Markdown summary (``report.md``) and PNG plots.

The Markdown names which average each AL column is (pooled over draft rounds, or the mean over
requests); both come from vLLM. Context buckets show their prompt count (flagged "not a
measurement" below 16), 95% intervals (``evaluate.intervals``) and the far-context measure
(``evaluate.farctx``). Plots are drawn by ``evaluate.plots`` (matplotlib, Agg backend).
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.evaluate.buckets import buckets_in_order
from eaglenest.evaluate.config import MIN_BUCKET_PROMPTS
from eaglenest.evaluate.plots import AL_PLOTS, al_plots
from eaglenest.provenance import write_json_atomic, write_text_atomic


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def md_cell(text) -> str:
    """``text`` as one Markdown table cell: a ``|`` escaped, line breaks as spaces (a group is a
    prompt file's ``category``, any text)."""
    return " ".join(str(text).replace("|", "\\|").split())


def _table(rows: list[tuple[str, dict]], k: int, first: str, extra: tuple[str, ...] = ()) -> list[str]:
    head = [first, *extra, "prompts", "AL pooled", "AL per-request", "accept rate"] + [f"pos {i + 1}" for i in range(k)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, d in rows:
        pos = list(d.get("acceptance_by_position") or []) + [None] * k
        cells = [md_cell(name), *(d.get(e) for e in extra), d["prompts"], d["acceptance_length"],
                 d.get("acceptance_length_per_request"), d["acceptance_rate"], *pos[:k]]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    return lines


def _ci(d: dict, key: str) -> str:
    """``value [low, high]`` when the bucket has an interval for ``key``."""
    ci = (d.get("intervals") or {}).get(key)
    return _fmt(d.get(key)) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _bucket_section(report: dict, k: int, conf: tuple[str, ...]) -> list[str]:
    """Prompts per bucket (flagged below 16), AL / ngram_al / target_confidence with 95% intervals,
    how often the output holds the material's answer, and the far-context measure."""
    rows = buckets_in_order(report)
    how = report.get("bucket_intervals") or {}
    counts = sorted({d.get("prompts") for _, d in rows})
    lines = [f"- Prompts per bucket: {', '.join(map(str, counts))}; material: "
             f"{', '.join(sorted({p['material'] for _, d in rows for p in d.get('per_prompt') or []})) or '-'}. "
             f"A bucket with fewer than {how.get('min_prompts', MIN_BUCKET_PROMPTS)} prompts is "
             "**not a measurement** (its interval is too narrow to trust; one prompt has none)."]
    if how:
        lines.append(f"- [low, high]: {int(how['level'] * 100)}% interval, {how['method']}, "
                     f"{how['resamples']} resamples, seed {how['seed']}.")
    lines.append("- **evidence >=**: the fewest tokens between a prompt's evidence and its end (records, code, "
                 "recall); **answer found**: share of those prompts whose output holds the reference answer.")
    for first, others in sorted((report.get("context_buckets_merged") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"- Buckets {', '.join(map(str, others))} shorten to the prompt tokens of bucket {first} (the "
                     f"target's positions less {report.get('bucket_max_tokens')} output tokens): decoded once, "
                     f"reported as bucket {first}.")
    ratio = how.get("ratio_to_shortest") or {}
    if ratio:
        lines.append(f"- **AL / {ratio['bucket']}**: the bucket's pooled AL over the shortest bucket's; interval: "
                     f"{ratio['method']}.")
    head = ["bucket", "prompt_tokens", "prompts", "AL pooled", f"AL / {ratio.get('bucket', 'shortest')}",
            "AL per-request", *[f"{c}" for c in conf],
            "evidence >=", "answer found", "accept rate"] + [f"pos {i + 1}" for i in range(k)] + ["note"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, d in rows:
        per = d.get("per_prompt") or []
        dist = [p["evidence_distance_tokens"] for p in per if p.get("evidence_distance_tokens") is not None]
        found = [p["answer_found"] for p in per if p.get("answer_found") is not None]
        pos = list(d.get("acceptance_by_position") or []) + [None] * k
        cells = [name, _fmt(d.get("prompt_tokens")), _fmt(d["prompts"]), _ci(d, "acceptance_length"),
                 _ci(d, "al_ratio_to_shortest") if "al_ratio_to_shortest" in d else "-",
                 _fmt(d.get("acceptance_length_per_request")), *[_ci(d, c) for c in conf],
                 _fmt(min(dist) if dist else None), f"{sum(found)}/{len(found)}" if found else "-",
                 _fmt(d["acceptance_rate"]), *[_fmt(x) for x in pos[:k]], d.get("note") or ""]
        lines.append("| " + " | ".join(cells) + " |")
    pred = report.get("predictability") or {}
    if pred.get("far_context"):
        lines += ["", "### How much the target uses far context", "",
                  f"- {pred['far_context']}; ratio = far removed / kept, difference = kept - far removed "
                  "(> 0: the target's output depends on the far part).", "",
                  "| bucket | prompts probed | kept | far removed | ratio | difference | answers scored | "
                  "answer value kept | far removed | difference |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, d in rows:
            f, iv = d.get("far_context") or {}, d.get("intervals") or {}
            lines.append(f"| {name} | {_fmt(f.get('prompts'))} | {_fmt(f.get('confidence_kept'))} | "
                         f"{_fmt(f.get('confidence_far_removed'))} | {_fmt(f.get('ratio'))} | "
                         f"{_with_ci(f.get('difference'), iv.get('far_context_difference'))} | "
                         f"{_fmt(f.get('answer_prompts'))} | {_fmt(f.get('answer_value_kept'))} | "
                         f"{_fmt(f.get('answer_value_removed'))} | "
                         f"{_with_ci(f.get('answer_value_difference'), iv.get('answer_value_difference'))} |")
        if pred.get("far_context_answers"):
            lines += ["", f"- Answer value: {pred['far_context_answers']}."]
        for name, d in rows:
            unscored = (d.get("far_context") or {}).get("answers_unscored")
            if unscored:
                lines.append(f"- Bucket {name}: answer value not scored for {', '.join(unscored)}: no room for the "
                             "answer after the prompt within the engine's max_model_len.")
    elif pred.get("far_context_skipped"):
        lines += ["", f"- Far-context use not measured: {pred['far_context_skipped']}."]
    return lines


def _with_ci(value, ci) -> str:
    return f"{_fmt(value)}{f' [{ci[0]:.3f}, {ci[1]:.3f}]' if ci else ''}"


def _prompts_line(p: dict) -> str:
    """How many prompts were loaded, excluded as overlapping the training pool, left out by
    ``evaluate.max_prompts_per_domain`` and evaluated (a report from before the cap was counted has
    the first two only)."""
    line = (f"- Prompts loaded: {p.get('loaded')}; excluded as overlapping the training pool: "
            f"{p.get('overlap_excluded')} ({p.get('overlap_check')})")
    if p.get("over_cap"):
        line += f"; beyond evaluate.max_prompts_per_domain={p.get('max_prompts_per_domain')}: {p['over_cap']}"
    if "evaluated" in p:
        line += f"; evaluated: {p['evaluated']}"
    if p.get("decoded_raw"):
        line += (f"; decoded as raw completions, without the chat template (stored raw by ingest: raw_fraction "
                 f"1.0, a base model's or a domain's): {p['decoded_raw']}")
    missing = p.get("domains_not_evaluated") or {}
    if missing:
        line += "; not evaluated: " + ", ".join(f"{md_cell(g)} ({why})" for g, why in missing.items())
    if p.get("empty_first_turn"):
        line += (f"; skipped for an empty first turn: {p['empty_first_turn']} (question_id "
                 f"{md_cell(', '.join(map(str, p.get('empty_first_turn_ids') or [])))})")
    return line + "."


def markdown(report: dict) -> str:
    k = report["num_speculative_tokens"]
    avg = report.get("averages") or {"acceptance_length": report["al_average"]}
    p = report.get("prompts") or {}
    lines = [
        f"# Acceptance length: {report['draft']}",
        "",
        f"Target `{report['target']}`, {k} speculative tokens, temperature {report['temperature']}, "
        f"prompt set `{p.get('prompt_set', report['split'])}`. Everything is measured by vLLM itself.",
        "",
        *[f"- **{'AL pooled' if key == 'acceptance_length' else 'AL per-request'}**: {text}."
          for key, text in avg.items()],
        "- **pos k**: share of draft rounds whose k-th draft token was accepted (pooled).",
    ]
    if p:
        lines.append(_prompts_line(p))
    lines += ["", "## By domain" if p.get("prompt_set", "heldout") == "heldout" else "## By category", ""]
    pred = report.get("predictability") or {}
    conf = tuple(c for c, key in (("target_confidence", "measure"), ("ngram_al", "ngram")) if pred.get(key))
    lines += _table(list(report["domains"].items()) + [("**overall**", report["overall"])], k, "group", extra=conf)
    if pred.get("measure"):
        lines += ["", f"- **target_confidence**: {pred['measure']}.",
                  f"- Spearman rank correlation of AL pooled with target_confidence over groups: "
                  f"{_fmt(pred.get('spearman_al_vs_confidence'))} "
                  "(1: AL follows the target's predictability exactly; -1: the reverse)."]
    if pred.get("ngram"):
        lines += [f"- **ngram_al**: {pred['ngram']['measure']}.",
                  f"- Spearman rank correlation of AL pooled with ngram_al over groups: "
                  f"{_fmt(pred.get('spearman_al_vs_ngram'))} (1: AL follows how predictable the text is "
                  "for a drafter)."]
    elif pred.get("ngram_skipped"):
        lines += [f"- ngram_al not measured: {pred['ngram_skipped']}."]
    modes = report.get("modes") or {}
    if len(modes) > 1:  # held-out prompts stored both ways: chat through the template, raw as completions
        lines += ["", "## By prompt mode (chat: through the target's chat template; raw: a completion, as "
                      "ingest stored it)", ""]
        lines += _table(list(modes.items()), k, "mode", extra=conf)  # the measures report.json has per mode
    if report.get("context_buckets"):
        lines += ["", f"## By context length ({report.get('bucket_max_tokens')} output tokens per prompt)", ""]
        lines += _bucket_section(report, k, conf)
    if "lossless" in report:
        ll = report["lossless"]
        lines += ["", f"Lossless check (greedy, same prompts without speculation): "
                      f"{ll['identical']}/{ll['prompts']} outputs token-for-token identical."]
    return "\n".join(lines) + "\n"


def unmark(outdir: str | Path) -> None:
    """Remove ``outdir``'s report.json, the mark of a finished run, before anything of a new run is
    written there: a new run killed half-way must not leave an earlier report.json (and its cache key)
    beside the new run's report.md, plots or provenance.json."""
    (Path(outdir) / "report.json").unlink(missing_ok=True)


def plot_names(report: dict) -> list[str]:
    """The plots :func:`write_report` draws for ``report`` (``al_by_context.png`` only with context buckets)."""
    return [n for n in AL_PLOTS if n != "al_by_context.png" or buckets_in_order(report)]


def restore_report(outdir: str | Path, report: dict) -> list[Path]:
    """Rewrite from ``report`` (the folder's report.json, a finished run's) the files of that run the folder
    lacks: report.md, a plot (removed by hand, or a copy of report.json alone); returns them. Nothing is
    measured; report.json and what is there are left as they are (a missing plot redraws the plots: about a
    second)."""
    outdir = Path(outdir)
    written = []
    if not (outdir / "report.md").is_file():
        write_text_atomic(outdir / "report.md", markdown(report))
        written.append(outdir / "report.md")
    missing = [outdir / n for n in plot_names(report) if not (outdir / n).is_file()]
    if missing:
        al_plots(report, outdir)
        written += missing
    return written


def write_report(outdir: str | Path, report: dict, *, plots: bool = True) -> list[Path]:
    """Write report.md, (unless ``plots`` is off) the PNG plots, then report.json; returns the PNGs. An
    earlier run's plots that this report does not draw (no buckets, plots off) are removed.
    report.json comes last: ``evaluate al`` takes it (its cache key) as the mark of a finished run, so a
    run killed while writing the rest is measured again instead of left without its plots."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    unmark(outdir)
    write_text_atomic(outdir / "report.md", markdown(report))
    pngs = al_plots(report, outdir) if plots else []
    for name in set(AL_PLOTS) - {p.name for p in pngs}:  # an earlier run's plot of what this report lacks
        (outdir / name).unlink(missing_ok=True)
    write_json_atomic(outdir / "report.json", report)
    return pngs
