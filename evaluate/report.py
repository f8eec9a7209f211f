"""Write an evaluation report as ``report.json`` and a Markdown table (``report.md``)."""

from __future__ import annotations

from pathlib import Path

from eaglenest.provenance import write_json_atomic


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def markdown(report: dict) -> str:
    k = report["num_speculative_tokens"]
    head = ["domain", "prompts", "AL", "accept rate"] + [f"pos {i + 1}" for i in range(k)]
    lines = [
        f"# Acceptance length: {report['draft']}",
        "",
        f"Target `{report['target']}`, {k} speculative tokens, temperature {report['temperature']}, "
        f"split `{report['split']}`. AL is {report['al_average']}; measured from vLLM's spec-decode counters.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    rows = list(report["domains"].items()) + [("**overall**", report["overall"])]
    for name, d in rows:
        pos = list(d.get("acceptance_by_position") or []) + [None] * k
        cells = [name, d["prompts"], d["acceptance_length"], d["acceptance_rate"], *pos[:k]]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    if "lossless" in report:
        ll = report["lossless"]
        lines += ["", f"Lossless check (greedy, same prompts without speculation): "
                      f"{ll['identical']}/{ll['prompts']} outputs token-for-token identical."]
    return "\n".join(lines) + "\n"


def write_report(outdir: str | Path, report: dict) -> None:
    outdir = Path(outdir)
    write_json_atomic(outdir / "report.json", report)
    tmp = outdir / ".report.md.tmp"
    tmp.write_text(markdown(report), encoding="utf-8")
    tmp.replace(outdir / "report.md")
