"""``ingest build``'s bookkeeping at its edges (scripted backend, ingest_helpers.py: no engine)."""

from __future__ import annotations

from eaglenest.config import build as build_cfg
from eaglenest.engine import EngineConfig
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import PoolEntry, raw_text

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _manifest() -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 4},
                                "domains": {"d": {"sources": [{"path": "x", "provenance": "p"}]}}})


def _entry(name: str, prompt: str, *, mode: str = "chat") -> PoolEntry:
    return PoolEntry(sample_id=f"d-{name}", domain="d", source="s", split="train", mode=mode, system="", prompt=prompt)


def test_a_prompt_of_exactly_max_model_len_tokens_is_left_out(tmp_path, tiny_target):
    # vLLM refuses a prompt of max_model_len tokens too (no room for one output token): on every run.
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    entry = _entry("a", "count the words in this sentence " * 20, mode="raw")
    n = len(tok(raw_text(entry))["input_ids"])  # what vLLM counts for a raw prompt: special tokens included
    for limit, dropped in ((n, 1), (n + 1, 0)):
        stats = build(_manifest(), [entry], target=str(tiny_target), store_uri=str(tmp_path / f"s{limit}"),
                      cfg=IngestConfig(engine=EngineConfig(max_model_len=limit)), backend=Scripted(tok))
        assert stats["prompt_too_long"]["dropped"] == dropped and stats["regenerated"] == 1 - dropped


class _Reversed(Scripted):
    """Answers each batch of requests in the reverse order (as an engine finishes short answers first)."""

    def poll(self):
        return list(reversed(super().poll()))


def test_a_shard_is_stored_in_pool_order_whatever_order_its_answers_come_in(tmp_path, tiny_target):
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    pool = [_entry(f"p{i}", f"question number {i}") for i in range(6)]
    uri = str(tmp_path / "s")
    build(_manifest(), pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(commit_every=6),
          backend=_Reversed(tok))
    stored = store.read(uri, store.PROMPTS, columns=["sample_id"]).column("sample_id").to_pylist()
    assert stored == [e.sample_id for e in pool]
