"""Reasoning targets over ``ingest.backend=endpoints``: the merged ``chat_template_kwargs`` go in the
OpenAI request body (``chat_template_kwargs``), a real vLLM server of the thinking fixture renders
with them (its prompt ids pass the backend's own template check, which uses the same kwargs), and
answers cut off inside the open think block are dropped and counted per domain as in process."""

from __future__ import annotations

import collections
import json
import textwrap

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool

pytestmark = pytest.mark.slow


def test_endpoints_send_the_kwargs_and_drop_truncated_thinking(tmp_path, root, thinking_target):
    from eaglenest.serve.server import Server

    manifest = tmp_path / "m.yaml"
    manifest.write_text("name: ep\nlicence: CC0-1.0\nraw_fraction: 0.0\ngeneration:\n  max_tokens: 6\ndomains:"
                        + "".join(textwrap.dedent(f"""
                              {d}:
                                cap_prompts: 5
                                held_out_count: 1
                                sources:
                                  - path: {root}/recipes/data/{d}.jsonl
                                    provenance: test
                            """).replace("\n", "\n  ") for d in ("arithmetic", "prose")))
    m = load_manifest(manifest)
    target = str(thinking_target)
    pool = load_pool(m, target=target)
    tok = load_tokenizer(thinking_target, trust_remote_code=False)
    with Server(target, memory_fraction=0.1, max_model_len=256, max_num_seqs=8, log_dir=tmp_path) as server:
        cfg = build_cfg(IngestConfig, {"backend": "endpoints", "endpoints": [server.url], "in_flight_per_endpoint": 2,
                                       "chat_template_kwargs": {"enable_thinking": True}})
        stats = build(m, pool, target=target, store_uri=str(tmp_path / "store"), cfg=cfg,
                      dropped_path=tmp_path / "dropped.json")
    rows = store.read(str(tmp_path / "store"), store.PROMPTS, filter="split = 'train'").to_pylist()
    assert stats["failed"] == 0, stats["failures"]  # the template check passed on every endpoint
    for r in rows:
        msgs = [x for x in json.loads(r["messages_json"]) if x["role"] != "assistant"]
        assert r["prompt_token_ids"] == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False, enable_thinking=True)
        assert tok.decode(r["prompt_token_ids"]).endswith("<|assistant|>\n<think>\n")
        assert r["finish_reason"] == "stop"
    cut = stats["thinking_truncated"]
    want = (collections.Counter(e.domain for e in pool if e.split == "train")
            - collections.Counter(r["domain"] for r in rows))
    assert cut["dropped"] >= 1 and cut["per_domain"] == dict(want)
