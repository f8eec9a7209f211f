"""Hostile manifests: domains that differ only in letter case, a held-out fraction set to null beside a count."""

from __future__ import annotations

import json
import textwrap

from eaglenest.ingest.manifest import read_manifest
from eaglenest.ingest.pool import load_pool


def _write(tmp_path, body: str):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i} about tides?"}) + "\n"
                                              for i in range(12)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i} about rivers?"}) + "\n"
                                              for i in range(12)))
    path = tmp_path / "m.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_domains_that_differ_only_in_case_are_refused(tmp_path):
    # "Code" and "code" were two domains: sample ids code-<hash> and Code-<hash>, two rows of stats and
    # reports, two sets of caps; most likely one domain typed twice. Not a YAML duplicate key, so nothing said.
    path = _write(tmp_path, """\
        name: m
        licence: CC0-1.0
        domains:
          code:
            cap_prompts: 5
            sources: [{path: a.jsonl, provenance: p}]
          Code:
            cap_prompts: 5
            sources: [{path: b.jsonl, provenance: p}]
        """)
    _, problems = read_manifest(path, base_dir=tmp_path)
    assert problems == ["domains.Code: the same name as domains.code but for letter case; give each domain its "
                        "own name (or merge their sources into one domain)"]


def test_a_null_held_out_fraction_beside_a_count_is_the_count(tmp_path):
    # "held_out_count: null  # or an exact held-out count; not both" reads as "null: not this one"; written the
    # other way round, `held_out_fraction: null` with a count was refused ("expected float, got None").
    path = _write(tmp_path, """\
        name: m
        licence: CC0-1.0
        held_out_fraction: null
        held_out_count: 3
        domains:
          tides:
            cap_prompts: 10
            sources: [{path: a.jsonl, provenance: p}]
        """)
    manifest, problems = read_manifest(path, base_dir=tmp_path)
    assert problems == []
    assert manifest.held_out("tides") == ("count", 3)
    pool = load_pool(manifest, base_dir=tmp_path)
    assert sum(e.split == "heldout" for e in pool) == 3 and len(pool) == 10


def test_a_system_field_that_is_the_prompt_column_is_refused(tmp_path):
    # `system_field: prompt` beside the default `field: prompt` sent every prompt with itself as its system
    # prompt, the whole pool, without a word.
    path = _write(tmp_path, """\
        name: m
        licence: CC0-1.0
        domains:
          tides:
            cap_prompts: 10
            sources: [{path: a.jsonl, provenance: p, system_field: prompt}]
        """)
    _, problems = read_manifest(path, base_dir=tmp_path)
    assert problems == ["domains.tides.sources[0].system_field: 'prompt' is the prompt's column (field) too; name "
                        "the column that holds the system prompt, or leave system_field out"]
