"""A scripted regeneration backend for ingest tests of the build's bookkeeping (no engine)."""

from __future__ import annotations

import contextlib
import http.server
import threading

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
