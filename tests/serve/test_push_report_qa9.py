"""``serve push`` reading ``evaluate al``'s report.json for the model card (QA9).

``evaluate.num_speculative_tokens`` takes up to 128 draft tokens a round (what vLLM verifies), but the card's
reader refused any report measured past 64 as damaged ("num_speculative_tokens: not a count of draft
tokens; run `evaluate al` again"): measuring again could not help. And a report.json holding NaN (json reads
it; a hand edit, another tool's report) was published in the card as the measured AL "nan".
"""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.engine import MAX_NUM_SPECULATIVE_TOKENS
from eaglenest.errors import EaglenestError
from eaglenest.serve.push import plan_push, read_report


def _report(k: int, al) -> dict:
    row = {"prompts": 3, "acceptance_length": al, "acceptance_length_per_request": 1.5,
           "acceptance_by_position": [0.5] + [0.0] * (k - 1)}
    return {"draft": "d", "num_speculative_tokens": k, "temperature": 0.0, "domains": {"prose": row}, "overall": row}


@pytest.mark.parametrize("k", [1, 8, 96, MAX_NUM_SPECULATIVE_TOKENS])
def test_a_report_of_any_k_evaluate_measures_is_read(tmp_path, k):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report(k, 1.5)))
    assert read_report(path) == _report(k, 1.5)  # read as written, nothing dropped or changed


def test_a_k_past_what_vllm_verifies_is_still_refused(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report(MAX_NUM_SPECULATIVE_TOKENS + 1, 1.5)))
    with pytest.raises(EaglenestError, match="num_speculative_tokens: not a count of draft tokens"):
        read_report(path)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_al_is_refused_naming_the_key(tmp_path, bad):
    path = tmp_path / "eval dir" / "report.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_report(3, 1.5)).replace('"acceptance_length": 1.5', f'"acceptance_length": {bad}', 1))
    with pytest.raises(EaglenestError, match=r"domains\.prose\.acceptance_length: not a number; run `evaluate al` "):
        read_report(path)


def test_the_card_of_a_k_96_report_has_every_position(tmp_path, toy_export):
    draft = tmp_path / "draft"
    shutil.copytree(toy_export, draft)
    report = {**_report(96, 1.5), "draft": str(draft)}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    plan = plan_push(draft, repo_id="me/draft", licences={"a": "CC0-1.0"}, report=read_report(path))
    assert "| pos 96 |" in plan.card and "96 draft tokens" in plan.card
    assert "| pos 97 |" not in plan.card  # as many position columns as the report measured
