"""Held-out prompts stored both ways (QA8): chat rows and raw rows (ingest stores a domain's held-out
prompts raw where that domain's ``raw_fraction`` is 1.0, chat elsewhere). Each is decoded in the mode it
was stored in, and the report gives AL per mode as well as per domain: before the fix it pooled both
modes into one figure per domain, so a chat draft's AL on completions could not be told apart.

One engine (K=8, past the draft's trained depth) and one lossless pass over a store with a domain named
with blanks and non-ASCII letters, a domain of one prompt and a domain holding both modes.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.offline import offline_al
from eaglenest.evaluate.prompts import load_prompt_set
from eaglenest.evaluate.report import markdown, write_report
from eaglenest.evaluate.run import evaluate_al

pytestmark = pytest.mark.slow

MIXED = "mixed dömain ü"
ROWS = [  # (sample id, domain, mode, system, prompt)
    ("m-0", MIXED, "chat", "", "What is 12 + 30?"), ("m-1", MIXED, "raw", "Be brief.", "Count from 3 to 6."),
    ("m-2", MIXED, "raw", "", "The sea is"), ("m-3", MIXED, "chat", "", "Describe a quiet morning."),
    ("r-0", "raw only", "raw", "", "Once upon a time"), ("o-0", "one", "chat", "", "Tell me about rain."),
]


def _row(sid, domain, mode, system, text):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return dict(sample_id=sid, domain=domain, source="test", split="heldout", mode=mode,
                messages_json=json.dumps(msgs, ensure_ascii=False), prompt_token_ids=[], response_token_ids=[],
                finish_reason="", gen_params_id="g")


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    uri = str(tmp_path_factory.mktemp("mixed modes") / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist([_row(*r) for r in ROWS], schema=S.PROMPTS_SCHEMA))
    return uri


@pytest.fixture(scope="module")
def report(tiny_target, random_draft, mixed_store):
    cfg = EvaluateConfig(max_tokens=16, num_speculative_tokens=8, ngram_order=0, context_buckets=(),
                         engine=EngineConfig(max_model_len=512, memory_fraction=0.1))
    got = evaluate_al(target=str(tiny_target), draft=str(random_draft), store_uri=mixed_store, cfg=cfg)
    return got


def test_al_is_reported_per_mode_and_pools_to_overall(report):
    modes, overall = report["modes"], report["overall"]
    assert {m: r["prompts"] for m, r in modes.items()} == {"chat": 3, "raw": 3}
    for key in ("draft_rounds", "accepted_tokens", "draft_tokens"):
        assert sum(r[key] for r in modes.values()) == overall[key], key
    for row in modes.values():
        assert row["draft_rounds"] > 0 and len(row["acceptance_by_position"]) == 8
        assert row["acceptance_length_from_histograms"] == pytest.approx(row["acceptance_length"], abs=1e-3)
    assert report["lossless"]["all_identical"] and report["lossless"]["prompts"] == 6  # raw ones too


def test_a_domain_holding_both_modes_has_a_row_per_mode(report, tmp_path):
    mixed = report["domains"][MIXED]
    assert {m: r["prompts"] for m, r in mixed["modes"].items()} == {"chat": 2, "raw": 2}
    assert sum(r["draft_rounds"] for r in mixed["modes"].values()) == mixed["draft_rounds"]
    assert mixed["prompts"] == 4 and report["domains"]["one"]["prompts"] == 1
    assert "modes" not in report["domains"]["raw only"]  # one mode: its row is that mode's
    text = markdown(report)
    assert "## By prompt mode" in text and f"\n| {MIXED} | " in text
    # The mode table has each mode's target_confidence (report.json's since QA9), derived here from the groups'
    # rows: a mode's tokens are those of the groups' rows of that mode, so its confidence is their token-weighted
    # mean (the lossless pass's outputs are the speculative ones, so its tokens are the rows' output tokens).
    def pooled(*rows):
        return sum(r["target_confidence"] * r["output_tokens"] for r in rows) / sum(r["output_tokens"] for r in rows)

    domains = report["domains"]
    want = {"chat": pooled(mixed["modes"]["chat"], domains["one"]),
            "raw": pooled(mixed["modes"]["raw"], domains["raw only"])}
    assert report["predictability"]["measure"] and "ngram_al" not in report["modes"]["chat"]  # ngram_order=0
    rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip().strip("|").split("|")]
                                          for line in text.splitlines() if line.startswith(("| raw |", "| chat |")))}
    assert set(rows) == {"chat", "raw"}
    for mode, cells in rows.items():
        assert float(cells[1]) == pytest.approx(want[mode], abs=6e-4) and cells[2] == "3", (mode, cells)
    write_report(tmp_path, report)  # report.json, report.md and the plots of a report with modes
    assert json.loads((tmp_path / "report.json").read_text())["modes"] == report["modes"]


def test_offline_reports_per_mode_too(tiny_target, random_draft, mixed_store):
    groups, info = load_prompt_set(EvaluateConfig(), mixed_store)
    assert info["decoded_raw"] == 3
    rep = offline_al(target=tiny_target, draft=random_draft, groups=groups, num_speculative_tokens=1, max_tokens=4)
    assert {m: r["prompts"] for m, r in rep["modes"].items()} == {"chat": 3, "raw": 3}
    assert sum(r["draft_rounds"] for r in rep["modes"].values()) == rep["overall"]["draft_rounds"]
