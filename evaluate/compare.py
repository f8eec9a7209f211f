"""``evaluate compare A B``: two drafts, or two evaluation reports, side by side.

``A``/``B`` are each a ``report.json`` (or a directory holding one), or an exported draft directory
(has ``config.json``), which is evaluated here with the recipe's evaluate settings on the same
prompts (no lossless re-check). Two feature-table versions are compared through the drafts trained
on them. The table shows pooled and per-request AL per group and per context bucket, and B - A.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from eaglenest.errors import EaglenestError
from eaglenest.paths import make_dir, shown_path
from eaglenest.evaluate.report import md_cell
from eaglenest.evaluate.run import evaluate_al
from eaglenest.evaluate.settings import check_draft_family, evaluate_config
from eaglenest.provenance import write_json_atomic, write_provenance, write_text_atomic


def _report(path: Path) -> dict:
    """An ``evaluate al`` report.json; anything else (not JSON, another JSON file) is one line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EaglenestError(f"compare: {path} is not a readable JSON report "
                             f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("overall"), dict) or "draft" not in data:
        raise EaglenestError(f"compare: {path} is not an `evaluate al` report.json (no 'draft' and 'overall')")
    check_report(data, path)
    return data


def check_report(data: dict, path: str | Path) -> None:
    """The fields :func:`side_by_side` reads have their types, or one line naming the file and key."""
    for section in ("domains", "context_buckets"):
        rows = data.get(section)
        if rows is not None and not isinstance(rows, dict):
            raise EaglenestError(f"compare: {shown_path(path)}: {section}: not an object of groups")
    rows = {"overall": data["overall"], **{f"{s}.{k}": v for s in ("domains", "context_buckets")
                                           for k, v in (data.get(s) or {}).items()}}
    for key, row in rows.items():
        if not isinstance(row, dict):
            raise EaglenestError(f"compare: {shown_path(path)}: {key}: not an object")
        for name in ("acceptance_length", "acceptance_length_per_request"):
            x = row.get(name)
            if x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool)):
                raise EaglenestError(f"compare: {shown_path(path)}: {key}.{name}: not a number, got {str(x)[:40]!r}")
            if x is not None and not _finite(x):  # json reads NaN / Infinity; compare.json would not be JSON
                raise EaglenestError(f"compare: {shown_path(path)}: {key}.{name}: not a finite number, "
                                     f"got {str(x)[:40]}")


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer past every float (1 followed by 400 zeros)
        return False


def _load(spec: str, recipe) -> dict:
    p = Path(spec)
    if p.is_file() and p.suffix == ".json":
        return _report(p)
    for name in ("report.json", "offline_report.json"):  # `evaluate al`'s folder, `evaluate offline`'s
        if (p / name).is_file():
            return _report(p / name)
    if (p / "config.json").is_file():
        check_draft_family(recipe, str(p))
        cfg = dataclasses.replace(evaluate_config(recipe, draft=str(p)), check_lossless=False)  # p's own K
        return evaluate_al(target=recipe.run.target, draft=str(p), store_uri=recipe.run.store_uri, cfg=cfg,
                           features_table=recipe.featurestore.table,  # the n-gram reference, as `evaluate al`
                           trust_remote_code=recipe.run.trust_remote_code)
    raise EaglenestError(f"compare: {spec} is neither a report.json nor an exported draft directory (nor a folder "
                         "with report.json or offline_report.json)")


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


#: What a report was measured with: a delta between reports that differ in one compares unlike measurements.
SETTINGS = ("target", "num_speculative_tokens", "temperature", "max_tokens", "bucket_max_tokens",
            "chat_template_kwargs", "split", "method")


def differences(a: dict, b: dict) -> dict[str, list]:
    """``{setting: [A's, B's]}`` for every :data:`SETTINGS` key (and the prompt set) the reports differ in,
    for their groups and context buckets (an overall AL over other groups is not a like delta), and
    (``prompts``) for the groups and buckets both have whose prompt counts or lengths differ."""
    def settings(r: dict) -> dict:
        prompts = r.get("prompts") if isinstance(r.get("prompts"), dict) else {}
        buckets = sorted(r.get("context_buckets") or {}, key=lambda k: (0, int(k)) if str(k).isdecimal() else (1, k))
        return {**{k: r.get(k) for k in SETTINGS}, "prompt_set": prompts.get("prompt_set"),
                "groups": sorted(r.get("domains") or {}), "context_buckets": buckets}

    x, y = settings(a), settings(b)
    out = {k: [x[k], y[k]] for k in x if x[k] != y[k]}
    u, v = _sizes(a), _sizes(b)
    unlike = [k for k in u if k in v and u[k] != v[k]]  # a group or bucket only one side has is named above
    if unlike:
        out["prompts"] = [{k: u[k] for k in unlike}, {k: v[k] for k in unlike}]
    return out


def _sizes(r: dict) -> dict:
    """Prompts per group, and per context bucket with their length (``ctx B``): the same names over
    other prompts (another ``max_prompts_per_domain`` or ``bucket_prompts``, a bucket shortened to
    another target's positions) are not a like delta either."""
    groups = {str(g): row.get("prompts") for g, row in (r.get("domains") or {}).items()}
    buckets = {f"ctx {b}": {"prompts": row.get("prompts"), "prompt_tokens": row.get("prompt_tokens")}
               for b, row in (r.get("context_buckets") or {}).items()}
    return {**groups, **buckets}


def side_by_side(a: dict, b: dict, *, names: tuple[str, str] = ("A", "B")) -> str:
    diff = differences(a, b)
    lines = [f"# Compare: {names[0]} = `{a['draft']}`, {names[1]} = `{b['draft']}`", "",
             "AL pooled = 1 + accepted / rounds (vLLM counters); per-request = mean of request ALs.", "",
             *(["**Not measured alike**, the deltas mix in: " + "; ".join(
                 f"{k} {names[0]} `{u}`, {names[1]} `{v}`" for k, (u, v) in diff.items()) + ".", ""] if diff else []),
             f"| group | {names[0]} pooled | {names[1]} pooled | delta | {names[0]} per-request | "
             f"{names[1]} per-request | delta |", "|---|---|---|---|---|---|---|"]
    for section, label in (("domains", ""), ("context_buckets", "ctx ")):
        keys = list(dict.fromkeys([*(a.get(section) or {}), *(b.get(section) or {})]))
        if section == "context_buckets":  # token counts (report.json sorts its keys as text: 16384 < 2048)
            keys.sort(key=lambda k: (0, int(k)) if str(k).isdecimal() else (1, str(k)))
        rows = [(label + k, (a.get(section) or {}).get(k, {}), (b.get(section) or {}).get(k, {})) for k in keys]
        if section == "domains":
            rows.append(("**overall**", a["overall"], b["overall"]))
        for name, x, y in rows:
            cells = []
            for key in ("acceptance_length", "acceptance_length_per_request"):
                u, v = x.get(key), y.get(key)
                cells += [_f(u), _f(v), _f(v - u) if u is not None and v is not None else "-"]
            lines.append(f"| {md_cell(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def compare(spec_a: str, spec_b: str, *, recipe, outdir: Path, key: str = "--out") -> str:
    a, b = _load(spec_a, recipe), _load(spec_b, recipe)
    md = side_by_side(a, b)
    make_dir(outdir, key)
    # compare.json last, an earlier run's removed first (as every evaluate command does with its result):
    # a run stopped while writing leaves no compare.json beside another run's compare.md or provenance.json.
    (outdir / "compare.json").unlink(missing_ok=True)
    write_text_atomic(outdir / "compare.md", md)
    write_provenance(outdir, config=recipe.to_dict(), inputs={"a": spec_a, "b": spec_b})
    write_json_atomic(outdir / "compare.json", {"a": a, "b": b, "inputs": [spec_a, spec_b],
                                                "settings_differ": differences(a, b)})
    return md
