"""``ingest build``'s own bookkeeping around the engine: training prompts the engine could never take
(``max_model_len``) are left out before any engine starts, and answers dropped for truncated thinking
are recorded as each shard finishes, so a run stopped later loses none of them. The engine here is a
small scripted backend (the ``submit``/``poll`` protocol of ``ingest/backends.py``): what is tested is
the build's accounting; real vLLM regenerates in tests/ingest/test_reasoning.py and test_stream.py,
and ``test_prompt_lengths_match_the_engine`` checks the length rule against vLLM itself."""

from __future__ import annotations

import json

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.engine import EngineConfig, close_llm, make_llm
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import build as build_module
from eaglenest.ingest.build import build, prompt_tokens
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import PoolEntry

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _manifest() -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 4},
                                "domains": {"d": {"sources": [{"path": "x", "provenance": "p"}]},
                                            "e": {"sources": [{"path": "y", "provenance": "p"}]}}})


def _entry(name: str, prompt: str, *, domain: str = "d", mode: str = "chat", split: str = "train") -> PoolEntry:
    return PoolEntry(sample_id=f"{domain}-{name}", domain=domain, source="s", split=split, mode=mode,
                     system="", prompt=prompt)


def test_prompts_past_max_model_len_are_left_out_before_any_engine(tmp_path, tiny_target):
    # A prompt of max_model_len tokens or more is refused by vLLM on every run: it was a failure each time,
    # after an engine start; now it is counted and left out, and no engine starts when nothing else is left.
    cfg = IngestConfig(engine=EngineConfig(max_model_len=64))
    long_text = "word " * 200
    pool = [_entry("a", long_text), _entry("b", long_text, domain="e", mode="raw"),
            _entry("h", "held out", split="heldout")]
    stats = build(_manifest(), pool, target=str(tiny_target), store_uri=str(tmp_path / "s"), cfg=cfg)
    assert stats["shards"] == 0 and stats["regenerated"] == 0 and stats["failed"] == 0
    long = stats["prompt_too_long"]
    assert long["dropped"] == 2 and long["per_domain"] == {"d": 1, "e": 1} and long["max_model_len"] == 64
    assert long["longest"] >= 200
    assert store.sample_ids(str(tmp_path / "s"), store.PROMPTS) == {"d-h"}


def test_long_prompts_are_left_out_and_the_rest_regenerated(tmp_path, tiny_target):
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    backend = Scripted(tok)
    cfg = IngestConfig(engine=EngineConfig(max_model_len=64))
    pool = [_entry("a", "word " * 200), _entry("b", "a short question")]
    stats = build(_manifest(), pool, target=str(tiny_target), store_uri=str(tmp_path / "s"), cfg=cfg, backend=backend)
    assert backend.requests == ["d-b"] and stats["regenerated"] == 1 and stats["prompt_too_long"]["dropped"] == 1
    # a larger window tries it again (nothing recorded that would skip it)
    again = build(_manifest(), pool, target=str(tiny_target), store_uri=str(tmp_path / "s"),
                  cfg=IngestConfig(engine=EngineConfig(max_model_len=4096)), backend=backend)
    assert backend.requests[-1] == "d-a" and again["regenerated"] == 1 and again["prompt_too_long"]["dropped"] == 0


def test_thinking_drops_are_recorded_when_their_shard_ends(tmp_path, thinking_target, monkeypatch):
    # The record of drops was written after the last shard: a run stopped at a later shard (Ctrl-C, a
    # failed commit) regenerated the earlier shards' drops again next time, to the same cut-off.
    tok = load_tokenizer(str(thinking_target), trust_remote_code=False)
    pool = [_entry("t0", "think about a"), _entry("t1", "think about b"), _entry("ok0", "plain c"),
            _entry("ok1", "plain d")]
    pool = sorted(pool, key=lambda e: not e.sample_id.startswith("d-t"))  # the drops fill the first shard
    dropped = tmp_path / "ingest" / "thinking_truncated.json"

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "commit", stopped)  # the second shard's commit never happens
    with pytest.raises(KeyboardInterrupt):
        build(_manifest(), pool, target=str(thinking_target), store_uri=str(tmp_path / "s"),
              cfg=IngestConfig(commit_every=2), backend=Scripted(tok), dropped_path=dropped)
    recorded = json.loads(dropped.read_text())
    assert [sorted(ids) for ids in recorded.values()] == [["d-t0", "d-t1"]]


@pytest.mark.slow
def test_prompt_lengths_match_the_engine(tiny_target):
    # The length the build computes is the one vLLM counts, for chat and raw prompts alike.
    from vllm import SamplingParams

    gen = _manifest().generation
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    chat, raw = _entry("c", "tell me more " * 20), _entry("r", "once upon a time " * 20, mode="raw")
    llm = make_llm(str(tiny_target), EngineConfig(max_model_len=512, max_num_seqs=2, memory_fraction=0.05))
    try:
        params = SamplingParams(max_tokens=1)
        (c,) = llm.chat([chat.messages()], params, use_tqdm=False)
        (r,) = llm.generate([build_module.raw_text(raw)], params, use_tqdm=False)
    finally:
        close_llm(llm)
    assert prompt_tokens(tok, chat, gen, {}, limit=64) == len(c.prompt_token_ids)
    assert prompt_tokens(tok, raw, gen, {}, limit=64) == len(r.prompt_token_ids)
