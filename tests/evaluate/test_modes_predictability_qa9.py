"""QA pass 9: the per-mode rows (``report["modes"]``, and a group's own ``modes`` when it holds chat and raw
prompts) are "rows like a domain's" (docs/evaluate.md), yet ``target_confidence`` and ``ngram_al`` were put on
the groups and ``overall`` only: a mixed store's report could not say whether the raw completions were less
predictable than the chats. Recomputed here from the per-prompt probabilities and an n-gram table."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pytest

from eaglenest.evaluate import ngram
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.run import ngram_predictability, predictability

sys.path.insert(0, str(Path(__file__).parents[1] / "featurestore"))
import fs_helpers as H  # noqa: E402

CHAT = {"sample_id": "c0", "messages": []}
RAW = {"sample_id": "r0", "messages": [], "raw_text": "x"}
GROUPS = {"mixed": [CHAT, RAW], "chat only": [{"sample_id": "c1", "messages": []}]}


def _report() -> dict:
    return {"domains": {"mixed": {"modes": {"chat": {}, "raw": {}}}, "chat only": {}}, "overall": {},
            "modes": {"chat": {}, "raw": {}}, "context_buckets": {}}


def test_target_confidence_is_on_every_mode_row():
    probs = {"c0": [0.9, 0.7], "r0": [0.2], "c1": [0.5, 0.5, 0.2]}
    report = _report()
    predictability(report, GROUPS, {}, probs)
    assert report["modes"]["chat"]["target_confidence"] == pytest.approx((0.9 + 0.7 + 0.5 + 0.5 + 0.2) / 5, abs=1e-4)
    assert report["modes"]["raw"]["target_confidence"] == pytest.approx(0.2)
    own = report["domains"]["mixed"]["modes"]
    assert own["chat"]["target_confidence"] == pytest.approx(0.8) and own["raw"]["target_confidence"] == 0.2
    assert report["domains"]["mixed"]["target_confidence"] == pytest.approx(0.6)


def test_ngram_al_is_on_every_mode_row(tmp_path):
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    m = H.meta()
    rows = H.rows(["a"], m, num_tokens=11)
    rows[0].update(input_ids=[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 8], loss_mask=[0] + [1] * 10)
    store.append(str(tmp_path), "features", pa.Table.from_pylist(rows, schema=S.features_schema(m)), meta=m)
    outputs = {"c0": [5, 6, 7, 5, 6], "r0": [9, 9, 9], "c1": [6, 7, 5]}
    prompt_ids = {"c0": [1], "r0": [1], "c1": [1, 5]}
    cfg = EvaluateConfig(num_speculative_tokens=2, ngram_order=2)
    report = _report()
    ngram_predictability(report, GROUPS, {}, outputs, prompt_ids, cfg, store_uri=str(tmp_path), table="features")
    table, _ = ngram.fit_from_store(str(tmp_path), "features", order=2, max_tokens=cfg.ngram_fit_tokens)

    def al(*sids):
        r = sum((ngram.simulate(table, prompt_ids[s], outputs[s], 2) for s in sids), ngram.Replay(by_position=[0, 0]))
        return r.acceptance_length

    assert report["modes"]["chat"]["ngram_al"] == pytest.approx(al("c0", "c1"))
    assert report["modes"]["raw"]["ngram_al"] == pytest.approx(al("r0"))
    assert report["modes"]["chat"]["ngram_al"] > report["modes"]["raw"]["ngram_al"]  # the table knows 5 6 7
    # By hand, the table of 1 5 6 7 5 6 7 5 6 7 8 (order 2; after 6 7 and after 7 it guesses 5, seen twice):
    # c0 (prompt 1, output 5 6 7 5 6): round 1 guesses 6 7, both accepted, 5 emitted; round 2 guesses 6 7, 6
    # accepted and the output ends: 2 rounds, 3 accepted. c1 (prompt 1 5, output 6 7 5): one round, 7 5
    # accepted. r0 (output 9 9 9): nothing follows 9, 2 rounds without a guess.
    assert report["modes"]["chat"]["ngram_al"] == pytest.approx(1 + (3 + 2) / (2 + 1), abs=1e-4)
    assert report["modes"]["raw"]["ngram_al"] == pytest.approx(1.0)
    assert report["domains"]["mixed"]["modes"]["chat"]["ngram_al"] == pytest.approx(1 + 3 / 2, abs=1e-4)
    assert report["domains"]["mixed"]["ngram_al"] == pytest.approx(1 + 3 / (2 + 2), abs=1e-4)  # c0 and r0 pooled
    assert report["domains"]["chat only"]["ngram_al"] == pytest.approx(1 + 2 / 1, abs=1e-4)
    own = report["domains"]["mixed"]["modes"]
    assert own["chat"]["ngram_al"] == pytest.approx(al("c0")) and own["raw"]["ngram_al"] == pytest.approx(al("r0"))
    assert len(own["chat"]["ngram_acceptance_by_position"]) == 2
