"""Seventh QA pass on the endpoint backend against a real vLLM server (max_model_len 512): a request
the server refuses says why. A prompt (or a later turn of a long chat) past the server's window came
back as a bare `HTTP 400` in every failure line and stats.json, the server's reason (its maximum
context length) thrown away with the error body."""

from __future__ import annotations

import pytest

from eaglenest.ingest import backends
from eaglenest.ingest.manifest import Generation

pytestmark = pytest.mark.slow


def test_a_request_the_server_refuses_names_the_servers_reason(tiny_target, vllm_server):
    backend = backends.EndpointBackend([vllm_server], target=str(tiny_target), max_retries=1, backoff_s=0.01)
    try:
        long_chat = [{"role": "user", "content": "tell me more about it " * 200}]  # well past 512 tokens
        (done,) = backend.chat([long_chat], Generation(max_tokens=4))
        (short,) = backend.chat([[{"role": "user", "content": "hi"}]], Generation(max_tokens=4))
    finally:
        backend.close()
    assert isinstance(done, backends.Failure) and isinstance(short, backends.Completion)
    last = done.error.split("last: ", 1)[1]
    assert last.startswith(f"{vllm_server}/v1/chat/completions: HTTP 400: ")
    assert "512" in last and "context length" in last  # vLLM's own words: "maximum context length is 512 tokens"
    assert "\n" not in done.error and len(last) < 400
