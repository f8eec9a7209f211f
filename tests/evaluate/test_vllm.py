"""Real vLLM on CPU: ``evaluate_al`` (groups, context buckets, both averages, lossless) and
``evaluate throughput``'s sweep over its two managed servers (target alone, target + draft), checked
against the servers' own counters. One test at a time; a random-init draft."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from eaglenest.engine import EngineConfig
from eaglenest.evaluate.config import EvaluateConfig
from eaglenest.evaluate.report import write_report
from eaglenest.evaluate.run import evaluate_al
from eaglenest.serve.server import Server

pytestmark = pytest.mark.slow


def test_evaluate_al_buckets_and_averages(tmp_path, tiny_target, random_draft, prompts_store):
    # Two prompts per bucket: a generated records registry and held-out chats; the far-context
    # probe keeps 255 tokens, so at 256 it removes one token (kept and removed must agree: this
    # checks the prompt_logprobs alignment) and at 1024 three quarters of the prompt.
    cfg = EvaluateConfig(max_tokens=24, context_buckets=(256, 1024), bucket_prompts=2, bucket_max_tokens=24,
                         bucket_material=("records", "chat"), far_context_keep_tokens=255,
                         far_context_probe_tokens=4, bootstrap_resamples=200,
                         engine=EngineConfig(max_model_len=512, memory_fraction=0.1))
    r = evaluate_al(target=str(tiny_target), draft=str(random_draft), store_uri=prompts_store, cfg=cfg)
    assert set(r["domains"]) == {"arithmetic", "prose"} and r["overall"]["prompts"] == 6
    assert r["prompts"]["overlap_ids"] == ["arithmetic-dup"]
    assert {b: v["prompt_tokens"] for b, v in r["context_buckets"].items()} == {"256": 256, "1024": 1024}
    for row in [*r["domains"].values(), *r["context_buckets"].values()]:
        assert row["draft_rounds"] > 0 and len(row["acceptance_by_position"]) == 3
        # Pooled AL from the per-request histograms equals the engine counters' delta.
        assert row["acceptance_length_from_histograms"] == pytest.approx(row["acceptance_length"], abs=1e-3)
        assert row["requests_with_drafts"] == row["prompts"]
        assert 1.0 <= row["acceptance_length_per_request"] <= 4.0
    assert r["overall"]["acceptance_length_per_request"] is not None
    assert r["lossless"]["all_identical"] and r["lossless"]["prompts"] == 10  # 6 chats + 2 x 2 bucket prompts
    conf = {g: d["target_confidence"] for g, d in [*r["domains"].items(), *r["context_buckets"].items()]}
    assert all(0.0 < c <= 1.0 for c in conf.values()), conf
    # The tiny target's card: arithmetic is far more predictable than prose; the target's own
    # confidence on its held-out outputs must say the same.
    assert conf["arithmetic"] > conf["prose"] + 0.05, conf
    assert "spearman_al_vs_confidence" in r["predictability"]  # None here: only two groups
    # No features table in this store: the n-gram measure says why it is missing instead of failing.
    assert "no features table" in r["predictability"]["ngram_skipped"]
    for b, row in r["context_buckets"].items():
        per = row["per_prompt"]
        assert [p["material"] for p in per] == ["records", "chat"]
        assert per[0]["evidence_distance_tokens"] > 0 and per[1]["evidence_distance_tokens"] is None
        # Per-prompt counts (vLLM's per-request metrics) pool to the engine counters' AL.
        pooled = 1 + sum(p["accepted_tokens"] for p in per) / sum(p["draft_rounds"] for p in per)
        assert pooled == pytest.approx(row["acceptance_length"], abs=1e-3)
        iv = row["intervals"]
        for key in ("acceptance_length", "target_confidence"):
            assert iv[key][0] <= row[key] + 1e-4 and row[key] <= iv[key][1] + 1e-4, (b, key, iv)
        assert row["measurement"] is False and "not a measurement" in row["note"]
        far = row["far_context"]
        assert far["prompts"] == 2 and 0 < far["confidence_far_removed"] <= 1 and 0 < far["confidence_kept"] <= 1
        # The records prompt's reference answer: its value tokens scored with the far part kept and removed.
        # (The demo's target cannot retrieve at all: its value-token odds may round to 0.)
        assert far["answer_prompts"] == 1 and per[0]["answer_tokens"] >= 1
        assert 0 <= far["answer_value_kept"] <= 1 and 0 <= far["answer_value_removed"] <= 1
    near = r["context_buckets"]["256"]["far_context"]  # one token removed: the same continuation odds
    assert abs(near["difference"]) < 0.05 and abs(near["answer_value_difference"]) < 0.05, near
    assert "last 255 tokens" in r["predictability"]["far_context"]
    assert "last 255 tokens" in r["predictability"]["far_context_answers"]
    pngs = write_report(tmp_path, r)
    assert {p.name for p in pngs} == {"al_by_domain.png", "al_by_context.png", "acceptance_by_position.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    md = (tmp_path / "report.md").read_text()
    assert "AL per-request" in md and "| 1024 | 1024 |" in md and "target_confidence" in md
    assert "ngram_al not measured" in md and "How much the target uses far context" in md
    assert "answer value kept" in md and "- Answer value: mean probability" in md
    assert "Prompts per bucket: 2" in md and "not a measurement: 2 prompt(s) < 16" in md
    assert json.loads((tmp_path / "report.json").read_text())["overall"]["acceptance_length"] > 0


def test_throughput_sweep_baseline_is_a_separate_target_only_server(tmp_path, tiny_target, random_draft,
                                                                     prompts_store, monkeypatch):
    """``run_sweep`` as ``evaluate throughput`` runs it: two managed servers. The baseline's own
    counters must show no drafting and the speculative one's must, both arms must produce the same
    text, the tokens the client counted must be the tokens each server generated, and the speed-up
    must be the ratio of the measured rates. The old one-server arrangement fails check_arms."""
    from eaglenest.errors import EaglenestError
    from eaglenest.evaluate.throughput import check_arms, markdown, run_sweep

    started, first = [], {}
    enter = Server.__enter__

    def recording_enter(self):  # the managed servers, and one plain request to the speculative one
        server = enter(self)
        started.append(server)
        if "--speculative-config" in server.argv:
            body = {"model": "target", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                    "max_tokens": 8, "temperature": 0.0}
            first.update(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json())
        return server

    monkeypatch.setattr(Server, "__enter__", recording_enter)
    cfg = EvaluateConfig(concurrency=(1, 2), throughput_seeds=(0,), throughput_max_tokens=8, throughput_prompts=4,
                         max_prompts_per_domain=2, engine=EngineConfig(max_model_len=512, memory_fraction=0.1))
    r = run_sweep(target=str(tiny_target), draft=str(random_draft), store_uri=prompts_store, cfg=cfg,
                  serve_cfg=None, log_dir=tmp_path)
    # Two servers, the baseline without any speculative config; both gone, engines included.
    assert len(started) == 2 and ["--speculative-config" in s.argv for s in started] == [False, True]
    for server in started:
        assert server.proc.returncode is not None and server.log_path.stat().st_size > 0
        with pytest.raises(ProcessLookupError):  # the whole process group (engine included) is gone
            os.killpg(server.proc.pid, 0)
    spec = (first.get("metrics") or {}).get("speculative_decoding")
    assert spec and spec["num_spec_tokens"] == 3  # per-request metrics are on
    arms, base_c, spec_c = r["arms"], r["arms"]["counters"]["baseline"], r["arms"]["counters"]["speculative"]
    assert base_c["drafts"] == base_c["draft_tokens"] == base_c["accepted_tokens"] == 0, base_c
    assert spec_c["drafts"] > 0 and spec_c["draft_tokens"] == 3 * spec_c["drafts"], spec_c
    assert arms["acceptance_length"] == pytest.approx(1 + spec_c["accepted_tokens"] / spec_c["drafts"], abs=1e-4)
    assert arms["all_identical"] and arms["outputs_compared"] == arms["outputs_identical"] == 8  # 2 points x 4
    # The client's token counts against each server's own: warm-up (4 tokens) + every point.
    for mode, counters in arms["counters"].items():
        rows = r["modes"][mode]
        assert [row["concurrency"] for row in rows] == [1, 2]  # one row per level: `all` over none would pass
        assert all(row["output_tokens"] == 4 * 8 for row in rows)  # ignore_eos: requests x max_tokens
        extra = first["usage"]["completion_tokens"] if mode == "speculative" else 0  # the plain request above
        assert counters["generation_tokens"] == 4 + sum(row["output_tokens"] for row in rows) + extra, (mode, counters)
    assert [sp["concurrency"] for sp in r["speedup"]] == [1, 2]
    for sp, b, s in zip(r["speedup"], r["modes"]["baseline"], r["modes"]["speculative"]):
        assert sp["concurrency"] == b["concurrency"] == s["concurrency"]
        ratio = s["per_seed_output_tokens_per_s"][0] / b["per_seed_output_tokens_per_s"][0]
        assert sp["speedup"] == pytest.approx(ratio, abs=6e-4)  # the report rounds to 3 places
        assert sp["speedup_per_seed"]["median"] == pytest.approx(ratio, abs=6e-5)  # rounded to 4 places
        assert 0 < s["median_ttft_s"]["mean"] <= s["median_e2e_s"]["mean"]
    assert "baseline drafted 0 tokens" in markdown(r)  # the counters reach the report
    # The arrangement the old test used, one speculating server behind both arms, is refused.
    with pytest.raises(EaglenestError, match="baseline server drafted"):
        check_arms({}, {"baseline": spec_c, "speculative": spec_c})
    with pytest.raises(EaglenestError, match="speculative server drafted nothing"):  # a draft never loaded
        check_arms({}, {"baseline": base_c, "speculative": base_c})
