"""A scripted regeneration backend for ingest tests of the build's bookkeeping (no engine)."""

from __future__ import annotations

import contextlib
import shutil
import http.server
import threading

from eaglenest.hf import load_tokenizer
from eaglenest.ingest import backends
from eaglenest.ingest.backends import Completion


class Scripted:
    """Answers every request at once (the ``submit``/``poll`` protocol of ingest/backends.py) with
    "fine.", and a prompt holding ``think`` with an open think block cut by max_tokens: what is tested
    is the build's bookkeeping, not generation (real vLLM: test_stream.py, test_kill.py)."""

    chat_template_kwargs: dict = {}
    max_in_flight = 8
    retries = 0

    def __init__(self, tok):
        self.tok, self.ready, self.requests, self.kinds = tok, [], [], []

    def submit(self, key, kind, payload, gen):
        self.requests.append(key)
        self.kinds.append(kind)
        text = payload if kind == "raw" else payload[-1]["content"]
        answer = "<think> still going" if "think" in text else "fine."
        self.ready.append((key, Completion(self.tok(text)["input_ids"], self.tok(answer)["input_ids"], answer,
                                           "length" if "think" in text else "stop")))

    def poll(self):
        out, self.ready = self.ready, []
        return out

    def cancel(self):
        self.ready.clear()

    def close(self):
        pass


class Answers(http.server.BaseHTTPRequestHandler):
    """A loopback server that lists one model and answers every POST with ``server.body`` (HTTP 200)."""

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(b'{"data": [{"id": "m"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.server.body)

    def log_message(self, *args):
        pass


def serve(handler, body: bytes = b""):
    """A loopback HTTP server answering with ``handler`` (``server.body``; requests kept in ``server.seen``):
    ``(server, url)``; the caller shuts it down."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.body, httpd.seen = body, []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@contextlib.contextmanager
def endpoint(handler, target, *, body: bytes = b"", max_retries: int = 0):
    """:func:`serve` and an EndpointBackend on it: ``(server, url, backend)``, both closed after."""
    httpd, url = serve(handler, body)
    backend = backends.EndpointBackend([url], target=str(target), max_retries=max_retries, backoff_s=0, timeout_s=10)
    try:
        yield httpd, url, backend
    finally:
        backend.close()
        httpd.shutdown()


#: An offline stand-in for a gpt-oss (harmony format) target, shared by the ingest, capture and evaluate tests.
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
#: gpt-oss's chat template, cut to what a chat without tools uses: an earlier answer is rendered as its
#: final channel (the analysis of earlier turns is dropped), and channel tags inside a content are refused.
HARMONY_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if '<|channel|>' in message.content -%}{{ raise_exception('channel tags in the content field') }}"
    "{%- endif -%}"
    "{%- if message.thinking and loop.last -%}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ message.thinking }}<|end|>{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def harmony_target(tmp_path, tiny_target, *, special: bool = True):
    """A tiny-target copy with gpt-oss's template and (``special``) its special tokens, which text decoded as
    vLLM decodes it leaves out; without them the tags are plain text, kept in the answer's text."""
    root = tmp_path / "harmony target"
    shutil.copytree(tiny_target, root)
    tok = load_tokenizer(root, trust_remote_code=False)
    if special:
        tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(root)
    return root
