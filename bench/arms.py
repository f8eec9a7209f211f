"""What the side-by-side engine benches share (bench/ is not a package: loaded from the file beside
each script). Each arm runs a script in a fresh interpreter at the repository root; the script
prints one ``RESULT <json>`` line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_arm(script: str, *args: str, label: str) -> dict:
    """The JSON the arm ``script`` printed after ``RESULT ``; exits naming ``label`` if it failed."""
    p = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT, check=False)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"arm {label} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])
