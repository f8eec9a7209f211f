"""Answers of an OpenAI-compatible endpoint that no prompts table can hold; a loopback stub server, no engine."""

from __future__ import annotations

import json

from ingest_helpers import Answers, endpoint, serve  # tests/ingest on sys.path via conftest

from eaglenest.config import build as build_cfg
from eaglenest.featurestore.table import store
from eaglenest.ingest import backends
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation, Manifest
from eaglenest.ingest.pool import PoolEntry


# JSON may spell a lone surrogate ("\ud800"): Python reads it into a str that no UTF-8 writer (Arrow) takes.
_SURROGATE = json.dumps({"choices": [{"text": "fine \ud800 answer", "token_ids": [7, 8], "finish_reason": "stop"}],
                         "prompt_token_ids": [1, 2]}).encode()


def test_an_answer_text_that_is_not_valid_unicode_is_a_failed_request(tiny_target):
    with endpoint(Answers, tiny_target, body=_SURROGATE, max_retries=1) as (_, url, backend):
        backend.submit("k", "raw", "hello", Generation())
        ((key, result),) = backend.poll()
    assert key == "k" and isinstance(result, backends.Failure), result
    assert result.error.startswith(f"2 attempt(s) failed; last: {url}/v1/completions: ") and "\n" not in result.error


def test_a_build_on_such_answers_fails_the_requests_not_the_shard_write(tmp_path, tiny_target):
    # The Completion was accepted and the shard's Arrow write raised UnicodeEncodeError ("surrogates not
    # allowed"): a traceback after regeneration, every other answer of the shard lost with it.
    httpd, url = serve(Answers, _SURROGATE)
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "domains": {
        "d": {"cap_prompts": 5, "sources": [{"path": "x", "provenance": "p"}]}}})
    pool = [PoolEntry(sample_id=f"d-{i:016x}", domain="d", source="s", split="train", mode="raw", system="",
                      prompt=f"prompt {i}") for i in range(2)]
    cfg = IngestConfig(backend="endpoints", endpoints=[url], max_retries=0, retry_backoff_s=0)
    uri = str(tmp_path / "store")
    try:
        stats = build(m, pool, target=str(tiny_target), store_uri=uri, cfg=cfg)
    finally:
        httpd.shutdown()
    assert stats["failed"] == 2 and stats["regenerated"] == 0
    assert not store.exists(uri, store.PROMPTS)  # nothing written for them; the next run retries them


def test_thinking_a_reasoning_parser_moved_out_of_content_stays_in_the_stored_text(tiny_target):
    # docs/ingest.md: "With a server started with --reasoning-parser, the thinking comes back outside content;
    # the stored text is then decoded from the returned token ids, so it still holds the thinking." vLLM names
    # that field `reasoning` (`reasoning_content` before): either way the text is the answer's whole output.
    from eaglenest.hf import load_tokenizer

    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    output = "<think>two and two</think>4"
    ids = tok(output, add_special_tokens=False)["input_ids"]
    for field in ("reasoning", "reasoning_content"):
        body = {"model": "m", "prompt_token_ids": prompt, "choices": [{
            "message": {"role": "assistant", "content": "4", field: "two and two"}, "token_ids": ids,
            "finish_reason": "stop"}]}
        with endpoint(Answers, tiny_target, body=json.dumps(body).encode()) as (_, _url, backend):
            backend.submit("k", "chat", chat, Generation())
            ((_, result),) = backend.poll()
        assert isinstance(result, backends.Completion), (field, result)
        assert result.text == output and result.response_ids == ids, field
