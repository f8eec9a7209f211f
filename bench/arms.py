"""What the side-by-side engine benches share (bench/ is not a package: loaded from the file beside
each script). Each arm runs a script in a fresh interpreter at the repository root; the script
prints one ``RESULT <json>`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
