"""Seventh QA pass on ingest's long-context edges: what the chat template adds to a prompt counts
towards ``ingest.engine.max_model_len`` like the prompt's own tokens. The engine is a scripted backend
(tests/ingest/ingest_helpers.py): what is tested is the build's accounting before any request; the
length rule itself is checked against vLLM in test_build_limits.py."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.engine import EngineConfig
from eaglenest.errors import ManifestError
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.build import build, prompt_tokens
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest, load_manifest
from eaglenest.ingest.pool import PoolEntry, load_pool

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest

#: A default system preamble the template renders in front of every conversation (as Llama 3.x's date
#: header, Qwen's identity line or a tool-use preamble do), here about 300 tokens.
PREAMBLE = "You are a careful assistant. " * 50


@pytest.fixture(scope="module")
def preamble_target(tmp_path_factory, tiny_target):
    dst = tmp_path_factory.mktemp("preamble") / "target"
    shutil.copytree(tiny_target, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = "{{ '<|system|>\\n" + PREAMBLE + "<|end|>\\n' }}" + cfg["chat_template"]
    path.write_text(json.dumps(cfg))
    return dst


def _manifest() -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 4},
                                "domains": {"d": {"sources": [{"path": "x", "provenance": "p"}]}}})


def _entry(name: str, prompt: str) -> PoolEntry:
    return PoolEntry(sample_id=f"d-{name}", domain="d", source="s", split="train", mode="chat", system="",
                     prompt=prompt)


def test_a_chat_template_preamble_counts_towards_max_model_len(tmp_path, preamble_target):
    """A short prompt (under half of max_model_len in bytes) was never rendered, as if no template could
    add half the window: one whose template adds a long preamble went to the engine, which refused it on
    every run (a failed request each time; all of them: `ingest build` failed). Now it is counted as too
    long and left out before any request, like a long prompt."""
    tok = load_tokenizer(str(preamble_target), trust_remote_code=False)
    short = _entry("a", "What is two plus two?")
    rendered = tok.apply_chat_template(short.messages(), tokenize=True, add_generation_prompt=True,
                                       return_dict=False)
    assert len(rendered) > 256 > 2 * len(short.prompt.encode())  # the template alone takes it past the window
    assert prompt_tokens(tok, short, _manifest().generation, {}, limit=256) == len(rendered)
    backend = Scripted(tok)
    stats = build(_manifest(), [short], target=str(preamble_target), store_uri=str(tmp_path / "s"),
                  cfg=IngestConfig(engine=EngineConfig(max_model_len=256)), backend=backend)
    assert backend.requests == [] and stats["failed"] == 0
    assert stats["prompt_too_long"]["dropped"] == 1 and stats["prompt_too_long"]["longest"] == len(rendered)
    # a window that holds the preamble takes it
    again = build(_manifest(), [short], target=str(preamble_target), store_uri=str(tmp_path / "s"),
                  cfg=IngestConfig(engine=EngineConfig(max_model_len=1024)), backend=backend)
    assert backend.requests == ["d-a"] and again["regenerated"] == 1


def test_a_short_prompt_is_still_not_tokenized(tiny_target):
    """The shortcut stays for what the window certainly holds: 0 for a prompt whose rendered text is
    under half the window in bytes (no tokenization of every short prompt)."""
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    assert prompt_tokens(tok, _entry("b", "hi"), _manifest().generation, {}, limit=256) == 0


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, tiny_target):
    """The tiny target with no chat template (a base model: plain completions only)."""
    dst = tmp_path_factory.mktemp("base") / "base model"
    shutil.copytree(tiny_target, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    del cfg["chat_template"]
    path.write_text(json.dumps(cfg))
    return dst


def test_a_base_model_is_ingested_with_every_prompt_raw(tmp_path, base_model):
    """A target with no chat template takes raw completions only, and ingest refuses chat prompts for it;
    but raw_fraction 1.0 (every single-turn training prompt raw) was refused as "not in [0, 1)", so a base
    model could not be ingested at all (whatever fraction below 1, some prompts were chat). 1.0 is taken,
    in the manifest and per domain; a value past it is still refused."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(12)))
    text = (f"name: base\nlicence: CC0-1.0\nraw_fraction: 1.0\nheld_out_count: 2\ndomains:\n  d:\n    cap_prompts: 12\n"
            f"    raw_fraction: {{r}}\n    sources:\n      - path: {src}\n        provenance: test\n")
    path = tmp_path / "m.yaml"
    path.write_text(text.format(r=1.0))
    m = load_manifest(path)
    pool = load_pool(m, target=str(base_model))
    assert {(e.split, e.mode) for e in pool} == {("train", "raw"), ("heldout", "raw")}  # held out: decoded raw
    tok = load_tokenizer(str(base_model), trust_remote_code=False)
    stats = build(m, pool, target=str(base_model), store_uri=str(tmp_path / "s"), cfg=IngestConfig(),
                  backend=Scripted(tok))
    assert stats["regenerated"] == 10 and stats["failed"] == 0
    path.write_text(text.format(r=1.5))
    with pytest.raises(ManifestError, match=r"domains\.d\.raw_fraction: 1\.5 is not in \[0, 1\]"):
        load_manifest(path)


def test_a_conversation_whose_user_turns_alone_pass_max_model_len_is_left_out_before_any_request(tmp_path,
                                                                                                 tiny_target):
    """Only a conversation's first request was measured: a multi-turn chat whose first turn fits but whose
    user turns together do not (a long ShareGPT chat) was answered turn by turn until the engine refused
    a later turn, on every run (the earlier turns' compute thrown away each time, a failed request each
    time). The later turns are rendered too (the answers to come left empty: they only add tokens), so it
    is counted as too long and never sent; a chat whose turns fit is sent as before."""
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    turn = "Please tell me a little more about the river and the old mill by the bridge. " * 3
    long_chat = PoolEntry(sample_id="d-long", domain="d", source="s", split="train", mode="chat", system="",
                          prompt=turn, later_turns=(turn, turn, turn))
    fits = PoolEntry(sample_id="d-fits", domain="d", source="s", split="train", mode="chat", system="",
                     prompt="hi", later_turns=("and then?",))
    first = len(tok.apply_chat_template(long_chat.messages(), tokenize=True, add_generation_prompt=True,
                                        return_dict=False))
    assert first < 256  # its first request alone fits
    n = prompt_tokens(tok, long_chat, _manifest().generation, {}, limit=256)
    assert n >= 256 and n > 3 * first
    backend = Scripted(tok)
    stats = build(_manifest(), [long_chat, fits], target=str(tiny_target), store_uri=str(tmp_path / "s"),
                  cfg=IngestConfig(engine=EngineConfig(max_model_len=256)), backend=backend)
    assert backend.requests == ["d-fits", "d-fits"] and stats["regenerated"] == 1 and stats["failed"] == 0
    assert stats["prompt_too_long"]["dropped"] == 1 and stats["prompt_too_long"]["longest"] == n
