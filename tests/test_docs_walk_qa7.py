"""What a seventh newcomer's walk of the docs found, each as a check that would catch it again
(beside tests/test_docs_consistent.py, tests/test_docs_walk_qa.py, qa2 and tables):

* docs/featurestore.md lists the temporary files a killed writer leaves that `featurestore gc` removes
  (``*.crc.tmp<pid>``, ``.eaglenest/tmp/<table>.*.lance``); gc also sweeps a killed stamp write's
  ``*.stamp.tmp<pid>`` and (since this session) a head or lineage record's ``*.json.tmp<pid>-<thread>``,
  and the page said neither. Here a real table gets one
  aged file of every kind gc sweeps, and each file gc removed must match a pattern the page names;
* docs/long_context.md gives the seeds of the evaluation's bucket prompts, to show they never meet the
  long-context build's training seeds: ``(0 * 1000003 + bucket) * 1000003 + i``, "at least
  1,024,003,072". Since bucket prompts are paired across lengths (prompt i asks the same question at
  every length) the code's is ``(seed * 1000003 + 2**20) * 1000003 + i`` for every bucket; the page kept
  the old formula and bound. Here the formula and bound the page states, and the training seed bases it
  names, are evaluated against ``evaluate.buckets`` and ``tinytarget.longdata``.

No engine, no subprocess: a real Lance table of a few rows, about a second.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import time
from pathlib import Path

from eaglenest.evaluate import buckets
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.featurestore.table import base, integrity, maintenance, store
from eaglenest.tinytarget import longdata

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent / "featurestore"))
import fs_helpers as H  # noqa: E402


def _gc_paragraph() -> str:
    """docs/featurestore.md's paragraph on ``featurestore gc --older-than-hours N``."""
    text = (ROOT / "docs" / "featurestore.md").read_text(encoding="utf-8")
    start = text.index("`featurestore gc --older-than-hours N")
    return text[start:text.index("\n\n", start)]


def _litter_patterns(paragraph: str) -> list[str]:
    """The globs of the temporary files the paragraph names (``*.crc.tmp<pid>``), placeholders as ``*``."""
    spans = re.findall(r"`([^`\n]*tmp[^`\n]*)`", paragraph)
    return [re.sub(r"<[^>]+>", "*", s) for s in spans]


def test_the_gc_paragraph_names_temporary_files():
    """The extraction finds what it is meant to (else the check below would pass on nothing)."""
    pats = _litter_patterns(_gc_paragraph())
    assert any(fnmatch.fnmatch("x.lance.crc.tmp12", p) for p in pats), pats
    assert not any(fnmatch.fnmatch("data/abc.lance", p) for p in pats), pats


def test_every_temporary_file_gc_removes_is_one_the_doc_names(tmp_path):
    uri, m = str(tmp_path / "my store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    table = base.table_path(uri, store.FEATURES)
    crc = table / integrity.CRC_DIR
    # One of each kind a killed writer leaves: a checksum's or stamp's, a side record's (head, gc lineage),
    # a table create's.
    data = next((table / "data").iterdir()).name
    planted = [crc / f"{data}.crc.tmp4242", crc / f"{data}.stamp.tmp4242",
               table / f"{base.HEAD_FILE}.tmp4242-1", table / "_eaglenest_gc_lineage.json.tmp4242-7",
               Path(uri) / ".eaglenest" / "tmp" / f"{store.FEATURES}.4242.lance"]
    old = time.time() - 3 * 3600
    for p in planted:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir() if p.suffix == ".lance" else p.write_text("{")
        os.utime(p, (old, old))
    found = maintenance.killed_writer_litter(uri, store.FEATURES, crc, time.time() - 3600)
    assert sorted(found) == sorted(planted), "gc sweeps another kind of file: plant one above"
    swept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert swept["temporary_files_removed"] == len(planted) and not any(p.exists() for p in planted)
    pats = _litter_patterns(_gc_paragraph())
    unnamed = [str(p.relative_to(uri)) for p in planted
               if not any(fnmatch.fnmatch(str(p.relative_to(uri)), f"*{pat}") for pat in pats)]
    assert not unnamed, f"docs/featurestore.md's gc paragraph ({pats}) names none of: {unnamed}"


# ---- docs/long_context.md: the evaluation's prompt seeds against the build's training seeds -------------

def _seeds_paragraph() -> str:
    text = (ROOT / "docs" / "long_context.md").read_text(encoding="utf-8")
    start = text.index("**Seeds (no train/test leakage).**")
    return text[start:text.index("\n\n", start)]


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_evaluation_seed_formula_the_page_gives_is_the_codes():
    para = _seeds_paragraph()
    formula = re.search(r"for engine\s+seed 0 \(`([^`]+)`, at least ([\d,]+)[;)]", para)
    assert formula, "docs/long_context.md no longer states the evaluation's seeds as `formula`, at least N"
    expr, floor = formula.group(1), _number(formula.group(2))
    assert set(re.findall(r"[A-Za-z_]\w*", expr)) <= {"bucket", "i"}, expr  # a plain arithmetic formula
    seen = []
    for bucket in EvaluateConfig().context_buckets:
        for i in range(4):
            shown = eval(expr, {"__builtins__": {}}, {"bucket": bucket, "i": i})  # noqa: S307 - the doc's arithmetic
            seen.append(buckets._prompt_seed(0, i))
            assert shown == seen[-1], f"the page's `{expr}` gives {shown} for bucket {bucket}, prompt {i}; " \
                                      f"the code seeds it {seen[-1]}"
    assert floor == min(seen), f"the page says at least {floor:,}, the smallest seed is {min(seen):,}"


def test_the_training_seed_bases_the_page_gives_are_the_codes():
    para = _seeds_paragraph()
    train = re.search(r"`TRAIN_SEED_BASE \+ row` \(([\d,]+) up\)", para)
    packed = re.search(r"`PACKED_SEED_BASE \+ 64 \* row \+ j` \(([\d,]+)\s+up\)", para)
    assert train and packed, "docs/long_context.md no longer names the training seed bases"
    assert _number(train.group(1)) == longdata.TRAIN_SEED_BASE
    assert _number(packed.group(1)) == longdata.PACKED_SEED_BASE and longdata.MAX_PACKED == 64
