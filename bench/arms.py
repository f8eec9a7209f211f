"""What the bench scripts share (bench/ is not a package: loaded from the file beside each script):
the side-by-side engine benches' arm runner (each arm runs a script in a fresh interpreter at the
repository root; the script prints one ``RESULT <json>`` line), argparse types for the numbers
the benches divide by or loop to, and :func:`run_unwinding` for the benches that make scratch data."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def run_unwinding(main) -> int:
    """Run a bench's ``main`` so that a SIGTERM (``kill``, a job's time limit) unwinds it as Ctrl-C does:
    its ``finally`` removes the scratch data (a GiB or more under ``--dir``) instead of leaving it behind;
    then the process ends by that signal, with one line."""
    from eaglenest.launch import Terminated, end_by_signal, unwind_on_sigterm

    unwind_on_sigterm()
    try:
        return main()
    except Terminated as exc:
        return end_by_signal(Path(sys.argv[0]).name, exc.signum)


def target_path(ap, target: str) -> str:
    """``--target`` as an absolute path (the arms run at the repository root, so a folder relative to
    the caller's would be looked up there; the repository's own default is found from anywhere), or a
    usage error naming it before any arm starts."""
    path = Path(target).expanduser()
    if not path.is_absolute() and not path.exists() and (ROOT / path).exists():
        path = ROOT / path
    if not (path / "config.json").is_file():
        ap.error(f"--target {target}: not a model folder (no config.json)")
    return str(path.resolve())


def run_arm(script: str, *args: str, label: str) -> dict:
    """The JSON the arm ``script`` printed after ``RESULT ``; exits naming ``label`` if it failed."""
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT, check=False)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"arm {label} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def number_above(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number above ``low`` (a rate a ratio divides by, a size a loop runs to)."""
    return _number(low, strict=True)


def number_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of at least ``low`` (a pause)."""
    return _number(low, strict=False)


def _number(low: float, *, strict: bool) -> Callable[[str], float]:
    bound = f"{'>' if strict else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}")
        return value

    parse.__name__ = f"number {bound}"
    return parse
