"""Real vLLM on CPU: ``evaluate_al`` (groups, context buckets, both averages, lossless) and a
managed server driven by the throughput client. One engine at a time; a random-init draft."""

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
from eaglenest.evaluate.throughput import summarise, sweep
from eaglenest.serve.server import Server

pytestmark = pytest.mark.slow


def test_evaluate_al_buckets_and_averages(tmp_path, tiny_target, random_draft, prompts_store):
    cfg = EvaluateConfig(max_tokens=24, context_buckets=(256, 1024), bucket_prompts=1, bucket_max_tokens=16,
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
    assert r["lossless"]["all_identical"] and r["lossless"]["prompts"] == 8  # 6 chats + 2 buckets
    conf = {g: d["target_confidence"] for g, d in [*r["domains"].items(), *r["context_buckets"].items()]}
    assert all(0.0 < c <= 1.0 for c in conf.values()), conf
    # The tiny target's card: arithmetic is far more predictable than prose; the target's own
    # confidence on its held-out outputs must say the same.
    assert conf["arithmetic"] > conf["prose"] + 0.05, conf
    assert "spearman_al_vs_confidence" in r["predictability"]  # None here: only two groups
    # No features table in this store: the n-gram measure says why it is missing instead of failing.
    assert "no features table" in r["predictability"]["ngram_skipped"]
    pngs = write_report(tmp_path, r)
    assert {p.name for p in pngs} == {"al_by_domain.png", "al_by_context.png", "acceptance_by_position.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    md = (tmp_path / "report.md").read_text()
    assert "AL per-request" in md and "| 1024 | 1024 |" in md and "target_confidence" in md
    assert "ngram_al not measured" in md
    assert json.loads((tmp_path / "report.json").read_text())["overall"]["acceptance_length"] > 0


def test_managed_server_and_sweep(tmp_path, tiny_target, random_draft):
    server = Server(str(tiny_target), draft=str(random_draft), memory_fraction=0.1, max_model_len=512,
                    log_dir=tmp_path)
    with server:
        body = {"model": "target", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                "max_tokens": 8, "temperature": 0.0}
        resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        assert resp["usage"]["completion_tokens"] == 8 or resp["choices"][0]["finish_reason"] == "stop"
        spec = (resp.get("metrics") or {}).get("speculative_decoding")
        assert spec and spec["num_spec_tokens"] == 3  # per-request metrics are on
        prompts = [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]
        # Both modes on the one server keep the test cheap; run_sweep starts two servers.
        points = sweep({"baseline": server.url, "speculative": server.url}, prompts, concurrency=(1, 2),
                       seeds=(0,), max_tokens=8, num_requests=4)
        pid = server.proc.pid
    modes, speedup = summarise(points)
    rows = modes["speculative"]
    assert [r["concurrency"] for r in rows] == [1, 2] == [s["concurrency"] for s in speedup]
    assert all(s["speedup"] > 0 for s in speedup)
    assert all(r["output_tokens"] == 32 and r["output_tokens_per_s"]["mean"] > 0 for r in rows)
    assert all(0 < r["median_ttft_s"]["mean"] <= r["median_e2e_s"]["mean"] for r in rows)
    assert server.proc.returncode is not None and server.log_path.stat().st_size > 0
    with pytest.raises(ProcessLookupError):  # the whole process group (engine included) is gone
        os.killpg(pid, 0)
