"""The endpoint backend against a real vLLM server: data parallel, retries, per-prompt failures;
and the Dask executor surviving a worker killed mid-shard."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.errors import ConfigError
from eaglenest.featurestore.table import store
from eaglenest.ingest import backends
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool

pytestmark = pytest.mark.slow


CAPS = {"arithmetic": 14, "code": 10}


def _setup(tmp_path, root, tiny_target, small_manifest, max_tokens=12):
    caps, write = small_manifest
    assert caps == CAPS
    m = load_manifest(write(tmp_path / "m.yaml", root, max_tokens=max_tokens))
    return m, load_pool(m, target=str(tiny_target))


def test_endpoints_retry_then_succeed_and_report_failures(tmp_path, root, tiny_target, vllm_server,
                                                          failing_server, monkeypatch, small_manifest):
    monkeypatch.setenv("EAGLENEST_TEST_KEY", "sk-secret-never-logged")
    m, pool = _setup(tmp_path, root, tiny_target, small_manifest)
    good = build_cfg(IngestConfig, {"backend": "endpoints", "endpoints": [failing_server, vllm_server],
                                    "retry_backoff_s": 0.01, "commit_every": 5,
                                    "api_key_env": "EAGLENEST_TEST_KEY"})
    uri = str(tmp_path / "a")
    stats = build(m, pool, target=str(tiny_target), store_uri=uri, cfg=good)
    assert stats["failed"] == 0 and stats["retries"] > 0  # half the first attempts hit the 500s
    t = store.read(uri, store.PROMPTS)
    assert collections.Counter(t.column("domain").to_pylist()) == CAPS
    rows = [r for r in t.to_pylist() if r["split"] == "train"]
    assert all(r["finish_reason"] in ("stop", "length") and r["response_token_ids"] for r in rows)
    assert any(r["mode"] == "raw" for r in rows) and any(r["mode"] == "chat" for r in rows)
    assert "sk-secret" not in json.dumps(stats)

    bad = build_cfg(IngestConfig, {"backend": "endpoints", "endpoints": [failing_server],
                                   "max_retries": 2, "retry_backoff_s": 0.01})
    uri = str(tmp_path / "b")
    stats = build(m, pool, target=str(tiny_target), store_uri=uri, cfg=bad)
    n_train = sum(e.split == "train" for e in pool)
    assert stats["failed"] == n_train and stats["regenerated"] == 0 and stats["retries"] == 2 * n_train
    assert all("3 attempt(s) failed; last:" in f["error"] and "HTTP 500" in f["error"] for f in stats["failures"])
    assert {f["sample_id"] for f in stats["failures"]} == {e.sample_id for e in pool if e.split == "train"}


def test_endpoints_default_to_loopback():
    with pytest.raises(ConfigError, match=r"ingest.endpoints\[0\]: 10.1.2.3 is not loopback"):
        backends.check_endpoints(["http://10.1.2.3:8000"], allow_remote=False)
    assert backends.check_endpoints(["http://10.1.2.3:8000/v1"], allow_remote=True) == ["http://10.1.2.3:8000"]


def test_multi_turn_feeds_own_answers_back(tmp_path, tiny_target, vllm_server):
    from eaglenest.ingest.manifest import Generation
    from eaglenest.ingest.pool import PoolEntry
    from eaglenest.ingest.regen import regenerate

    b = backends.EndpointBackend([vllm_server], target=str(tiny_target))
    e = PoolEntry(sample_id="d-1", domain="d", source="s", split="train", mode="chat", system="",
                  prompt="What is 2 + 3?", later_turns=("And times 4?", "Say it in words."))
    gen = Generation(max_tokens=8)
    (row,), failures = regenerate(b, [e], gen, "g")
    assert not failures
    msgs = json.loads(row["messages_json"])
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3
    # turn 2 was asked with the target's own earlier answers in the history
    first = b.chat([[msgs[0]]], gen)[0]
    assert first.text == msgs[1]["content"]
    second = b.chat([msgs[:3]], gen)[0]
    assert second.text == msgs[3]["content"]
    last = b.chat([msgs[:5]], gen)[0]
    assert row["prompt_token_ids"] == last.prompt_ids and row["response_token_ids"] == last.response_ids


def test_dask_worker_killed_mid_shard_loses_and_duplicates_nothing(tmp_path, root, tiny_target, vllm_server,
                                                                  monkeypatch, small_manifest):
    m, pool = _setup(tmp_path, root, tiny_target, small_manifest, max_tokens=48)
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("EAGLENEST_TEST_SHARD_STARTED", str(markers))
    cfg = build_cfg(IngestConfig, {"backend": "endpoints", "endpoints": [vllm_server], "executor": "dask",
                                   "dask_workers": 2, "commit_every": 4, "in_flight_per_endpoint": 2})
    killed = {}

    def killer():
        deadline = time.time() + 240
        while not killed and time.time() < deadline:
            for f in markers.iterdir():
                pid, shard = f.name.split("-", 1)
                os.kill(int(pid), signal.SIGKILL)
                killed["pid"], killed["shard"] = int(pid), shard
                return
            time.sleep(0.005)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    uri = str(tmp_path / "store")
    stats = build(m, pool, target=str(tiny_target), store_uri=uri, cfg=cfg)
    t.join()
    assert killed, "no shard started"
    starts = [f.name.split("-", 1) for f in markers.iterdir()]
    reruns = [int(p) for p, s in starts if s == killed["shard"]]
    assert len(reruns) >= 2 and any(p != killed["pid"] for p in reruns)  # the shard ran again elsewhere
    ids = store.read(uri, store.PROMPTS, columns=["sample_id"]).column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == sum(CAPS.values())
    assert stats["failed"] == 0 and stats["executor"] == "dask"
