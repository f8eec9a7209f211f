"""A base model (no chat template) ingested with ``raw_fraction: 1.0``: its held-out prompts are stored raw,
so evaluation decodes them as the raw completions ingest sends, not through a template the model lacks."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool
from ingest_helpers import Scripted


@pytest.fixture(scope="module")
def base_target(tmp_path_factory, tiny_target):
    """The tiny target without its chat template: a base model."""
    dst = tmp_path_factory.mktemp("base") / "base target"
    shutil.copytree(tiny_target, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def _manifest(tmp_path, raw: float, n: int = 40, held: str = "held_out_fraction: 0.5", chats: bool = True):
    """``n`` single-turn prompts, and (``chats``) one two-turn conversation, in one domain."""
    src, conv = tmp_path / "prompts.jsonl", tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(n)))
    conv.write_text(json.dumps({"messages": [{"role": "user", "content": "First turn?"},
                                             {"role": "user", "content": "Second?"}]}) + "\n")
    extra = f"      - path: {conv}\n        messages_field: messages\n        provenance: test\n" if chats else ""
    path = tmp_path / "m.yaml"
    path.write_text(f"name: base\nlicence: CC0-1.0\nraw_fraction: {raw}\n{held}\ndomains:\n  d:\n"
                    f"    cap_prompts: {n + 1}\n    sources:\n      - path: {src}\n        provenance: test\n" + extra)
    return load_manifest(path)


def test_held_out_prompts_of_a_base_model_are_stored_raw(tmp_path, tiny_target):
    """Held-out prompts were always stored as chat, whatever ``raw_fraction``: on a base model (1.0, every
    training prompt raw) `evaluate` then rendered them with the chat template it lacks and crashed. Every
    held-out prompt is now raw, as its training prompts are; a conversation too (evaluate decodes its first
    turn), while a training conversation stays chat (and is refused for a base model by ingest)."""
    pool = load_pool(_manifest(tmp_path, 1.0, held="held_out_count: 41"), target=str(tiny_target))
    assert {e.split for e in pool} == {"heldout"}
    assert {(e.mode, len(e.later_turns)) for e in pool} == {("raw", 0), ("raw", 1)}
    pool = load_pool(_manifest(tmp_path, 1.0, held="held_out_count: 0"), target=str(tiny_target))
    assert {(e.mode, len(e.later_turns)) for e in pool} == {("raw", 0), ("chat", 1)}


def test_held_out_prompts_stay_chat_below_raw_fraction_one(tmp_path, tiny_target):
    """Below 1.0 (a chat model that also learns raw completions) held-out prompts stay chat, as documented
    (docs/manifest.md), while training prompts are raw and chat."""
    pool = load_pool(_manifest(tmp_path, 0.5), target=str(tiny_target))
    assert {e.mode for e in pool if e.split == "heldout"} == {"chat"}
    assert {e.mode for e in pool if e.split == "train" and not e.later_turns} == {"raw", "chat"}


def test_a_base_model_store_holds_its_held_out_prompts_raw(tmp_path, base_target):
    """End of ingest: the prompts table's held-out rows of a base model are ``raw`` (what `evaluate` reads)."""
    m = _manifest(tmp_path, 1.0, n=12, held="held_out_count: 3", chats=False)
    pool = load_pool(m, target=str(base_target))
    uri = str(tmp_path / "s")
    stats = build(m, pool, target=str(base_target), store_uri=uri, cfg=IngestConfig(),
                  backend=Scripted(load_tokenizer(str(base_target), trust_remote_code=False)))
    assert stats["failed"] == 0
    rows = store.read(uri, store.PROMPTS, columns=["split", "mode"]).to_pylist()
    assert sorted((r["split"], r["mode"]) for r in rows) == [("heldout", "raw")] * 3 + [("train", "raw")] * 9
