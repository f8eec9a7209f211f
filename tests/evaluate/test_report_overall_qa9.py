"""QA pass 9: report.json's ``overall`` row, recomputed independently from the groups' rows of one real
``evaluate_al`` run (vLLM on CPU, the random-init draft, two small buckets and the lossless pass: shared by
the module), and report.json's keys against the table of them in docs/evaluate.md, both ways.

Before: ``overall`` was a subset of a group's row, built from the groups' rounded per-request means: no
``output_tokens``, ``acceptance_histogram``, ``acceptance_length_from_histograms`` (the documented check that
the per-request histograms pool to the counters' AL) nor the per-request median / min / max, which every group
row and every ``modes`` row (pooled over the same groups) carries. docs/evaluate.md named about half the keys
report.json holds (no table of them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eaglenest.engine import EngineConfig
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.report import markdown
from eaglenest.evaluate.run import evaluate_al

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tiny_target, random_draft, prompts_store):
    cfg = EvaluateConfig(max_tokens=16, context_buckets=(256, 512), bucket_prompts=2, bucket_max_tokens=16,
                         bucket_material=("records", "chat"), far_context_keep_tokens=200, far_context_probe_tokens=4,
                         bootstrap_resamples=100, engine=EngineConfig(max_model_len=1024, memory_fraction=0.1))
    return evaluate_al(target=str(tiny_target), draft=str(random_draft), store_uri=prompts_store, cfg=cfg)


def test_overall_has_every_key_a_group_row_has(report):
    overall, rows = report["overall"], list(report["domains"].values())
    assert len(rows) == 2 and all(r["draft_rounds"] > 0 for r in rows)
    missing = set().union(*map(set, rows)) - set(overall)
    assert not missing, f"overall lacks {sorted(missing)}"


def test_overall_pools_the_groups(report):
    overall, rows = report["overall"], list(report["domains"].values())
    for key in ("prompts", "output_tokens", "draft_rounds", "draft_tokens", "accepted_tokens", "requests_with_drafts"):
        assert overall[key] == sum(r[key] for r in rows), key
    rounds, accepted = sum(r["draft_rounds"] for r in rows), sum(r["accepted_tokens"] for r in rows)
    assert overall["acceptance_length"] == pytest.approx(1 + accepted / rounds, abs=1e-4)
    k = report["num_speculative_tokens"]
    hist = [sum(r["acceptance_histogram"][j] for r in rows) for j in range(k + 1)]
    assert overall["acceptance_histogram"] == hist
    assert sum(hist) == rounds  # every round counted once, by its accepted tokens
    assert overall["acceptance_length_from_histograms"] == pytest.approx(
        1 + sum(j * c for j, c in enumerate(hist)) / sum(hist), abs=1e-4)
    assert overall["acceptance_length_from_histograms"] == pytest.approx(overall["acceptance_length"], abs=1e-3)
    n = overall["requests_with_drafts"]
    mean = sum(r["acceptance_length_per_request"] * r["requests_with_drafts"] for r in rows) / n
    assert overall["acceptance_length_per_request"] == pytest.approx(mean, abs=2e-4)
    assert min(r["acceptance_length_per_request_min"] for r in rows) == overall["acceptance_length_per_request_min"]
    assert max(r["acceptance_length_per_request_max"] for r in rows) == overall["acceptance_length_per_request_max"]


def test_overall_is_the_one_mode_row_when_every_prompt_is_chat(report):
    assert list(report["modes"]) == ["chat"]
    chat = report["modes"]["chat"]  # the lossless pass adds target_confidence to the groups and overall only
    assert chat == {k: report["overall"][k] for k in chat}
    overall, k = report["overall"], report["num_speculative_tokens"]
    assert overall["prompts"] == 6  # the fixture's 3 + 3 held-out prompts (its duplicate of a training one left out)
    rows = [line for line in markdown(report).splitlines() if line.startswith("| **overall** |")]
    assert rows, "no overall row in report.md"
    cells = [c.strip() for c in rows[0].strip().strip("|").split("|")]  # the group table's overall row
    assert cells[-(4 + k):] == ["6", f"{overall['acceptance_length']:.3f}",
                                f"{overall['acceptance_length_per_request']:.3f}", f"{overall['acceptance_rate']:.3f}",
                                *(f"{x:.3f}" for x in overall["acceptance_by_position"])]


ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "evaluate.md"
#: Children named by the data (group, bucket, mode, domain names; the user's template kwargs), not by the schema.
DATA_NAMED = {"domains", "context_buckets", "modes", "context_buckets_merged", "domains_not_evaluated",
              "prompts_per_bucket", "chat_template_kwargs"}


def documented_keys(text: str) -> set[str]:
    """The backticked keys in the first column of docs/evaluate.md's "`report.json` keys" table."""
    start = text.find("### `report.json` keys")
    if start < 0:
        return set()
    section = text[start:text.find("\n## ", start)]
    return {k for line in section.splitlines() if line.startswith("| `")
            for k in re.findall(r"`([a-z_]+)`", line.split("|")[1])}


def written_keys(node, parent: str = "") -> set[str]:
    if isinstance(node, list):
        return set().union(set(), *(written_keys(x, parent) for x in node))
    if not isinstance(node, dict):
        return set()
    keys = set() if parent in DATA_NAMED else set(node)
    return keys.union(*(written_keys(v, "" if parent in DATA_NAMED else k) for k, v in node.items()))


def test_every_key_written_is_documented_and_every_key_documented_is_written(report):
    report = {**report, "cache_key": "0" * 16}  # set by `evaluate al` itself (evaluate/commands.py)
    doc = documented_keys(DOC.read_text(encoding="utf-8"))
    written = written_keys(report)
    assert {"per_prompt", "far_context", "lossless", "intervals", "al_ratio_to_shortest"} <= written  # a full report
    assert not written - doc, f"written, not in docs/evaluate.md's report.json table: {sorted(written - doc)}"
    sources = "".join(p.read_text(encoding="utf-8") for p in [*(ROOT / "evaluate").glob("*.py"),
                                                               ROOT / "common" / "specdecode.py"])
    never = {k for k in doc if f'"{k}"' not in sources}
    assert not never, f"documented in report.json's table, written nowhere in evaluate/: {sorted(never)}"
