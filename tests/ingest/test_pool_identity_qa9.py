"""What counts as the same prompt, at the edges: invisible characters, blank system prompts, Unicode forms,
case, domains sharing a source, the smallest caps (docs/manifest.md "How the pool is built")."""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.errors import ManifestError
from eaglenest.evaluate.prompts import exclude_overlap
from eaglenest.ingest import contamination
from eaglenest.ingest.manifest import Manifest, load_manifest
from eaglenest.ingest.pool import build_pool
from eaglenest.text import content_key


def _manifest(caps: dict[str, int] | None = None, **top) -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.0, "raw_fraction": 0.0, **top,
                                "domains": {d: {"cap_prompts": c, "sources": [{"path": "x", "provenance": "p"}]}
                                            for d, c in (caps or {"d": 100}).items()}})


def _row(prompt: str, system: str = "") -> dict:
    return {"prompt": prompt, "system": system, "source": "s"}


def _documented_id(domain: str, text: str) -> str:
    """docs/manifest.md: ``<domain>-`` and 16 hex digits of the sha256 of the text NFKC-normalised, lower-cased,
    whitespace squashed (for a text with no invisible character: nothing else to drop)."""
    key = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).strip().lower())
    return f"{domain}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


#: The same visible text: zero-width space (inside, at either end), BOM, soft hyphen, word joiner, a
#: left-to-right mark; NFD against NFC; case; a no-break space.
SAME = ["Hello world, café?", "Hello\u200b world, café?", "\ufeffHello world, café?", "Hello world, café?\u200b",
        "Hel\u00adlo world, café?", "Hello\u2060 world, cafe\u0301?", "\u200eHELLO WORLD, CAFÉ?",
        "Hello\u00a0world, café?"]


def test_prompts_that_look_the_same_are_one_sample():
    report: dict = {}
    pool = build_pool(_manifest(), {"d": [_row(p) for p in SAME]}, report=report)
    assert len(pool) == 1 and report["domains"]["d"]["exact_duplicates"] == len(SAME) - 1
    assert pool[0].sample_id == f"d-{content_key(SAME[0])[:16]}" == _documented_id("d", SAME[0])


def test_a_table_written_before_keeps_counting_invisible_characters():
    # Scheme 1 (a table written before): its ids as they were, so its rows with a zero-width space stay theirs.
    pool = build_pool(_manifest(), {"d": [_row(SAME[0]), _row(SAME[1])]}, id_scheme=1)
    assert len(pool) == 2


PERSIAN = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"  # "mi-khaham", the joiner keeping "mi" apart


@pytest.mark.parametrize("pair", [("\U0001F468\u200d\U0001F469", "\U0001F468\U0001F469"),  # an emoji ZWJ sequence
                                  (PERSIAN, PERSIAN.replace("\u200c", ""))])
def test_joiners_that_change_what_is_shown_still_count(pair):
    # U+200D joins "man, woman" into one family glyph; U+200C keeps Persian "mi-khaham" from joining.
    assert len(build_pool(_manifest(), {"d": [_row(p) for p in pair]})) == 2


def test_a_system_prompt_that_shows_nothing_is_no_system_prompt():
    # It was sent as a system message of a zero-width space (a template renders its whole system block) and made
    # the prompt another sample than the same prompt without one.
    pool = build_pool(_manifest(), {"d": [_row("Name a colour.", "\u200b"), _row("Name a colour.", " \ufeff ")]})
    assert len(pool) == 1 and pool[0].system == "" and pool[0].messages() == [{"role": "user",
                                                                              "content": "Name a colour."}]
    assert pool[0].sample_id == f"d-{content_key('Name a colour.')[:16]}" == _documented_id("d", "Name a colour.")


def test_an_evaluation_prompt_with_a_zero_width_space_is_still_caught(tmp_path):
    # A benchmark file pasted from the web: the question with a zero-width space and a BOM in it was not the
    # training prompt's key, so the training prompt was kept, and trained on.
    evals = tmp_path / "question.jsonl"
    evals.write_text(json.dumps({"turns": ["\ufeffWhat is the capital\u200b of France?"]}) + "\n")
    manifest = _manifest(contamination={"mt_bench": [str(evals)]})
    pool = build_pool(manifest, {"d": [_row("What is the capital of France?"), _row("Name a colour.")]})
    kept, report = contamination.check(pool, manifest)
    assert [e.prompt for e in kept] == ["Name a colour."] and report["by_reason"] == {"exact:eval": 1}


def test_evaluation_excludes_a_question_trained_on_that_differs_by_invisible_characters():
    train = {content_key("What is the capital of France?")}
    question = {"role": "user", "content": "What is the\u00ad capital of France?"}
    groups = {"g": [{"sample_id": "q", "messages": [question]}]}
    assert exclude_overlap(groups, train) == ({}, ["q"])


def test_two_domains_sharing_a_source_the_first_listed_owns_its_prompts():
    report: dict = {}
    rows = [_row(f"Question {i}?") for i in range(4)]
    pool = build_pool(_manifest({"a": 2, "b": 10}), {"a": rows, "b": rows}, report=report)
    assert {e.domain for e in pool} == {"a"} and len(pool) == 2
    # prompts a's cap leaves out are a's too: not passed on to b
    assert report["domains"]["b"] == {"rows": 4, "empty": 0, "exact_duplicates": 4, "near_duplicates": 0, "kept": 0,
                                      "held_out": 0}


def test_a_cap_of_one_keeps_the_lowest_hash_and_a_cap_of_zero_is_refused(tmp_path):
    rows = [_row(f"Question {i}?") for i in range(5)]
    pool = build_pool(_manifest({"d": 1}, held_out_count=1), {"d": rows})
    assert len(pool) == 1 and pool[0].split == "heldout"
    assert pool[0].sample_id == min(_documented_id("d", r["prompt"]) for r in rows)
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": "q"}) + "\n")
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\ndomains:\n  d:\n    cap_prompts: 0\n"
                 f"    sources: [{{path: '{src}', provenance: p}}]\n")
    with pytest.raises(ManifestError, match=r"domains\.d\.cap_prompts: must be at least 1"):
        load_manifest(m)


@pytest.mark.parametrize("fraction, held", [(0.0, 0), (0.999999, 20)])
def test_held_out_fraction_at_its_ends(fraction, held):
    pool = build_pool(_manifest(held_out_fraction=fraction), {"d": [_row(f"Question {i}?") for i in range(20)]})
    assert sum(e.split == "heldout" for e in pool) == held


def test_a_held_out_fraction_of_one_is_refused(tmp_path):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": "q"}) + "\n")
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\nheld_out_fraction: 1\ndomains:\n  d:\n    cap_prompts: 1\n"
                 f"    sources: [{{path: '{src}', provenance: p}}]\n")
    with pytest.raises(ManifestError, match=r"held_out_fraction: 1(\.0)? is not in \[0, 1\)"):
        load_manifest(m)
