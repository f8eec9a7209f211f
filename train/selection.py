"""Checkpoint selection by served acceptance length, and the run report (JSON + PNG).

Every ``train.select.every_steps`` steps (and at the last step) rank 0 saves the current draft as
a snapshot and hands it to ``score``, a function from a snapshot directory to
``{"served_al", "prompts"}``, and appends the result to ``selection.jsonl``. Scoring serves the
draft, so it needs the stages after this one (export, evaluate): the scorer is built above the
stages, in the ``train run`` command (:mod:`eaglenest.pipeline`), and passed in; this module keeps the books. The best
snapshot by served AL is kept in ``<outdir>/best/`` with its own record (``best/selection.json``: its
step and served AL); at the end it becomes the run's checkpoint (``checkpoint.json`` gains a
``selection`` record, labelled from best/'s own). A resumed run drops a best/ from after the step
it resumes at (its steps are trained again, as selection.jsonl is cut back), so best/ never carries
weights of one run segment under the served AL of another.

Trade-off: each evaluation starts a vLLM engine (~25 s on 2 CPU cores) while the other ranks
wait at a barrier, so selection is off by default and meant for sparse intervals. The held-out
slice is small, so served AL differences of a few hundredths are noise; ties keep the earlier step. A
snapshot vLLM measured no draft round of (every output ended at its first token) has no served AL: its
record says null, and it is never kept as best/ (not 0.0, which would keep an early snapshot as the run's).

``report.json`` / ``report.png``: loss, per-step accuracy and served AL against the step.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any, Callable

from eaglenest.errors import ConfigError, StoreError
from eaglenest.paths import read_json_object
from eaglenest.provenance import finite_or_null, write_json_atomic
from eaglenest.train import checkpoint
from eaglenest.train.config import SelectConfig

log = logging.getLogger(__name__)

SELECTION = "selection.jsonl"
#: The best snapshot by served AL (a checkpoint folder beside the run's own).
BEST = "best"
#: Inside best/: its own selection record ({"step", "served_al", ...}), written with the snapshot.
BEST_RECORD = "selection.json"
#: Where :meth:`Selector.evaluate` moves the previous best/ while the new one is renamed in (deleted after).
BEST_ASIDE = ".best.old"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of one of the run's books (metrics.jsonl, selection.jsonl). A last line cut short
    (no newline after it: a kill or a full disk while it was appended, always past the last state)
    is left out; any other line that is not a record with an integer ``step`` is a one-line StoreError."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):  # a torn append
                log.warning("%s: its last line was cut short (an interrupted write); left out", path)
                continue
            record = None
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise StoreError(f"{path}: line {number} is not a JSON record with an integer 'step'; delete the file "
                             "or set train.state.resume=never to start over")
        records.append(record)
    return records


def _line(record: dict) -> str:
    """``record`` as a strict-JSON line (a NaN or infinity, which jq and browsers refuse, as null)."""
    return json.dumps(finite_or_null(record, "", []), allow_nan=False) + "\n"


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the records with ``step <= step`` (all gone for a fresh run), atomically."""
    keep = [r for r in read_jsonl(path) if r["step"] <= step] if step else []
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(_line(r) for r in keep), encoding="utf-8")
    tmp.replace(path)


def require_scorer(cfg: SelectConfig, score) -> None:
    if cfg.every_steps and score is None:
        raise ConfigError("train.select.every_steps needs a served-AL scorer; the `train run` command "
                          "passes one (served_al_scorer in eaglenest.pipeline), a direct call of "
                          "eaglenest.train.loop.train must pass score=")


class Selector:
    """Served-AL evaluations and the best snapshot; inert unless ``active`` and selection is on."""

    def __init__(self, outdir: Path, *, cfg: SelectConfig, score: Callable[[Path], dict[str, Any]] | None, target_dir: str,
                 active: bool, resume_step: int):
        require_scorer(cfg, score)
        self.outdir, self.cfg, self.score, self.target_dir = outdir, cfg, score, target_dir
        self.on = bool(cfg.every_steps) and active
        self.path = outdir / SELECTION
        if not self.on:
            return
        outdir.mkdir(parents=True, exist_ok=True)
        recover_best(outdir)
        truncate_jsonl(self.path, resume_step)
        best = self.best() if resume_step else None
        if best is None or best["step"] > resume_step:  # a fresh run's, or of steps trained again now
            shutil.rmtree(outdir / BEST, ignore_errors=True)

    def best(self) -> dict[str, Any] | None:
        """best/'s own record (None when there is no best/ snapshot)."""
        return best_record(self.outdir)

    def evaluate(self, step: int, draft, *, info: dict[str, Any]) -> float | None:
        if not self.on or draft is None:
            return None
        if any(r["step"] == step for r in read_jsonl(self.path)):
            return None  # already evaluated before a resume
        work = self.outdir / "select"
        snap = checkpoint.save_checkpoint(work / "snapshot", draft, info=info)
        scored = self.score(snap)
        # None when vLLM ran no draft round (every output ended at its prefill token): unmeasured, not 0.0,
        # so such a snapshot is recorded as null and never kept as best/.
        al = scored.get("served_al")
        rec = {"step": step, "served_al": None if al is None else float(al), "prompts": scored.get("prompts"),
               "loss": (info.get("metrics") or {}).get("loss")}
        prev = self.best()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(_line(rec))
        if rec["served_al"] is None:
            log.warning("step %d: served AL not measured (no draft round: every output ended at its first "
                        "token, e.g. evaluate.max_tokens=1): not a candidate for best/", step)
            return None
        if math.isfinite(rec["served_al"]) and (prev is None or rec["served_al"] > prev["served_al"]):
            tmp = self.outdir / ".best.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(snap, tmp)
            write_json_atomic(tmp / BEST_RECORD, finite_or_null(rec, "", []))
            replace_best(self.outdir, tmp)
        log.info("step %d: served AL %.3f (best %.3f)", step, rec["served_al"], (self.best() or rec)["served_al"])
        return rec["served_al"]

    def finish(self, draft, info: dict[str, Any]):
        """(draft, info) to save as the run's checkpoint: the best snapshot's when selection ran."""
        best = self.best() if self.on else None
        if best is None:
            return draft, info
        model, binfo = checkpoint.load_checkpoint(self.outdir / BEST, target_dir=self.target_dir)
        binfo = {k: v for k, v in binfo.items() if k not in ("format", "draft_config")}
        binfo["selection"] = {"criterion": "served_al", "best_step": best["step"],
                              "best_served_al": best["served_al"], "last_step": info["step"],
                              "evaluations": len(read_jsonl(self.path))}
        return model, binfo


def replace_best(outdir: Path, new: Path) -> None:
    """Make the snapshot folder ``new`` the run's best/: the old best/ is renamed aside, the new one
    renamed in, then the old one deleted, so a kill at any moment leaves a whole best/ or its aside
    copy (which :func:`recover_best` puts back)."""
    best, aside = outdir / BEST, outdir / BEST_ASIDE
    recover_best(outdir)
    if best.exists():
        best.replace(aside)
    new.replace(best)
    shutil.rmtree(aside, ignore_errors=True)


def recover_best(outdir: Path) -> None:
    """Finish a best/ swap a kill interrupted: without a whole best/, the aside copy comes back;
    with one, the aside copy is the replaced snapshot and goes."""
    best, aside = outdir / BEST, outdir / BEST_ASIDE
    if not aside.exists():
        return
    if (best / checkpoint.INFO).is_file():
        shutil.rmtree(aside)
        return
    shutil.rmtree(best, ignore_errors=True)
    aside.replace(best)


def best_record(outdir: Path) -> dict[str, Any] | None:
    """The record of the snapshot in ``<outdir>/best/``: its own ``selection.json``; for a best/ saved
    before that file existed, selection.jsonl's record of the step its checkpoint.json names. None
    when there is no whole best/ snapshot or its step has no record."""
    best = outdir / BEST
    if not (best / checkpoint.INFO).is_file():
        return None
    own = best / BEST_RECORD
    if own.is_file():
        rec = read_json_object(own, error=StoreError, then="delete the best/ folder to select anew")
        if type(rec.get("step")) is not int or not isinstance(rec.get("served_al"), (int, float)):
            raise StoreError(f"{own}: not a record with an integer 'step' and a number 'served_al'; delete "
                             "the best/ folder to select anew")
        return rec
    step = read_json_object(best / checkpoint.INFO, error=StoreError, then="delete the best/ folder").get("step")
    return next((r for r in read_jsonl(outdir / SELECTION) if r["step"] == step), None)


def write_report(outdir: Path, *, stall_fraction: float, tokens_per_second: float) -> Path:
    """``report.json`` and ``report.png``: loss, per-step accuracy, served AL over steps; ``best``:
    the record of the snapshot the run kept (best/)."""
    metrics = read_jsonl(outdir / "metrics.jsonl")
    served = read_jsonl(outdir / SELECTION)
    report = {"metrics": metrics, "served_al": served, "stall_fraction": stall_fraction,
              "tokens_per_second": tokens_per_second, "best": best_record(outdir) if served else None}
    write_json_atomic(outdir / "report.json", report)
    _plot(outdir / "report.png", metrics, served)
    return outdir / "report.json"


def _plot(path: Path, metrics: list[dict], served: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [m["step"] for m in metrics]
    axes[0].plot(steps, [m["loss"] for m in metrics], marker=".")
    axes[0].set(title="TTT loss", xlabel="step")
    k = len(metrics[0]["step_acc"]) if metrics else 0
    for i in range(k):
        axes[1].plot(steps, [m["step_acc"][i] for m in metrics], label=f"k={i}")
    axes[1].set(title="top-1 accuracy per TTT step", xlabel="step", ylim=(0, 1))
    if k:
        axes[1].legend(fontsize=7, ncol=2)
    if served:
        axes[2].plot([r["step"] for r in served], [r["served_al"] for r in served], marker="o")
    else:
        axes[2].text(0.5, 0.5, "selection off\n(train.select.every_steps=0)", ha="center", va="center")
    axes[2].set(title="served acceptance length (vLLM)", xlabel="step")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
