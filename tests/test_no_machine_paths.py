"""No path that exists only on this project's own machines in tests, docs, recipes or benches.

A test that opens ``/work/shared/benchmarks/...`` passes here and fails in every other clone; a doc
that names it sends a user to a folder they do not have. Tests build the files they need (as the
rest of the suite does); docs name paths relative to the repository, or a placeholder. This scan
finds absolute paths into machine folders (``/work/``, ``/root/``, ``/home/<user>/``,
``/Users/<user>/``, ``/mnt/``, ``/scratch/``) and the build machines' sibling folder of the repo
(``../shared/``), in every text file of those trees. The same holds for a run's outputs under the
checkout's ``runs/`` (a test reading the demo's checkpoint passes after ``make demo`` and fails in a
fresh clone): no test reads them. No engine, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The trees and files a user gets with a clone and reads or runs.
SCANNED = ("tests", "docs", "recipes", "bench", "README.md", "BENCHMARKS.md", "Makefile", "pyproject.toml")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".toml", ".sh", ".txt", ".cfg", ".ini", ""}
#: A path segment that starts a machine folder: not preceded by a word character, a dot, a colon or
#: a slash (so URLs such as ``https://host/home/x`` and ``s3://bucket/work/`` do not count).
MACHINE = re.compile(r"(?<![\w.:/~$}-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+|mnt|scratch)/"
                     r"|(?<![\w.])\.\./shared/")


def machine_paths(text: str) -> list[str]:
    """The machine-folder paths in ``text`` (each as far as the next blank or quote)."""
    return [re.match(r"[^\s'\"`)\]>,]*", text[m.start():]).group(0) for m in MACHINE.finditer(text)]


def _files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                        and "__pycache__" not in p.parts)


@pytest.mark.parametrize("text, found", [
    ('MT_BENCH = "/work/shared/benchmarks/mt_bench/question.jsonl"', ["/work/shared/benchmarks/mt_bench/question.jsonl"]),
    ("mt_bench: [/work/shared/benchmarks/mt_bench/question.jsonl]", ["/work/shared/benchmarks/mt_bench/question.jsonl"]),
    ("see `/root/models/x` and /home/alice/data.jsonl", ["/root/models/x", "/home/alice/data.jsonl"]),
    ("evaluate.prompt_path=../shared/benchmarks/q.jsonl", ["../shared/benchmarks/q.jsonl"]),
    ("open('/Users/bob/q.jsonl')", ["/Users/bob/q.jsonl"]),
    ("run.store=s3://bucket/work/x and https://example.org/home/page", []),
    ("runs/toy/work/ and data/mt_bench/question.jsonl and tmp_path / 'work'", []),
    ("<dir>/<config>/*.parquet, /models/my-target, /tmp/x", []),
])
def test_the_scan_finds_machine_paths(text, found):
    assert machine_paths(text) == found


def test_no_machine_paths_in_tests_docs_recipes_and_benches():
    this = Path(__file__).resolve()
    files = list(_files())
    # Every tree and file named is there and read (a renamed one would be skipped silently).
    read = {p.relative_to(ROOT).parts[0] for p in files}
    assert read == set(SCANNED), f"not there, or nothing in them to read: {sorted(set(SCANNED) - read)}"
    hits = []
    for path in files:
        if path == this:  # its own examples above
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{lineno}: {p}" for p in machine_paths(line)]
    assert not hits, "paths that exist only on this project's machines (build the file in the test, or " \
                     "name a path relative to the repository or a placeholder):\n" + "\n".join(hits)


#: A test reading a run's outputs under the repository's ``runs/`` (the demo's, say): there only after
#: someone ran ``make demo`` in that checkout, never in a fresh clone (CI's).
RUN_OUTPUTS = re.compile(r"""(?:\b(?:root|ROOT)\s*/\s*["']runs["'])|["']runs/(?:toy|long)\b""")


@pytest.mark.parametrize("text, hit", [
    ('shutil.copy(root / "runs" / "toy" / "train" / name, dst)', True),
    ("json.loads((ROOT / 'runs' / 'toy' / 'eval' / 'report.json').read_text())", True),
    ('Path("runs/toy/draft")', True),
    ('f"run.workdir={tmp_path / \'runs\'}"', False),
    ("runs/toy/work/ in a docstring's prose", False),
])
def test_the_scan_finds_reads_of_run_outputs(text, hit):
    assert bool(RUN_OUTPUTS.search(text)) is hit


def test_no_test_reads_the_repositorys_run_outputs():
    this = Path(__file__).resolve()
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in sorted((ROOT / "tests").rglob("*.py")) if p != this
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if RUN_OUTPUTS.search(line)]
    assert not hits, "tests that read runs/ of the checkout (build what they need from the tiny target):\n" + \
        "\n".join(hits)
