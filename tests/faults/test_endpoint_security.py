"""The endpoint backend's API key goes only where the recipe points (issue #10).

A loopback server that answers every request with a redirect to another host must not get the key
forwarded there (urllib's default opener copies ``Authorization`` onto the redirected request), and
a key over plain http to a non-loopback host needs ``ingest.allow_plaintext_api_key``. Only loopback
traffic: 127.0.0.2 is loopback on Linux but another host for the redirect check; the non-loopback
address is refused before any request is made.
"""

from __future__ import annotations

import http.server
import logging
import threading

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.errors import ConfigError
from eaglenest.ingest import backends
from eaglenest.ingest.backends import EndpointBackend, Failure
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation

KEY = "sk-test-never-forwarded"
REMOTE = "http://10.255.255.1:9"  # never contacted: refused when the backend is constructed


def _serve(host: str, handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    srv = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://{host}:{srv.server_address[1]}"


@pytest.fixture
def servers():
    """(url of a server that redirects everything, url it redirects to, headers that one received)."""
    seen: list[dict] = []

    class Other(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(dict(self.headers))
            body = b'{"data": [{"id": "m"}], "choices": [{"text": "x", "token_ids": [1]}], "prompt_token_ids": [1]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    other, other_url = _serve("127.0.0.2", Other)

    class Redirect(http.server.BaseHTTPRequestHandler):
        def _redirect(self):
            self.send_response(302)
            self.send_header("Location", other_url + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = _redirect

        def log_message(self, *args):
            pass

    first, first_url = _serve("127.0.0.1", Redirect)
    yield first_url, other_url, seen
    for srv in (first, other):
        srv.shutdown()
        srv.server_close()


def test_redirect_to_another_host_is_refused_and_the_key_never_follows(servers, monkeypatch, tiny_target):
    first, other, seen = servers
    monkeypatch.setenv("EAGLENEST_TEST_KEY", KEY)
    b = EndpointBackend([first], target=str(tiny_target), api_key_env="EAGLENEST_TEST_KEY", max_retries=1,
                        backoff_s=0.0)
    (res,) = b.complete(["What is 2 + 3?"], Generation(max_tokens=4))
    assert isinstance(res, Failure)
    assert f"{first}/v1/models: refused a redirect (HTTP 302) to another host ({other})" in res.error
    assert "2 attempt(s) failed" in res.error and KEY not in res.error
    assert seen == []  # the other host was never contacted, so it never saw the key


def test_redirect_is_refused_without_a_key_too(servers, tiny_target):
    first, other, seen = servers
    (res,) = EndpointBackend([first], target=str(tiny_target), max_retries=0).complete(["hi"], Generation())
    assert isinstance(res, Failure) and "refused a redirect" in res.error and seen == []


def test_plaintext_key_to_a_remote_host_needs_the_opt_in(monkeypatch, tiny_target, caplog):
    monkeypatch.setenv("EAGLENEST_TEST_KEY", KEY)
    kw = {"target": str(tiny_target), "api_key_env": "EAGLENEST_TEST_KEY", "allow_remote": True}
    with pytest.raises(ConfigError, match=r"^ingest.allow_plaintext_api_key: ingest.endpoints\[0\] is plain http "
                                          r"to 10.255.255.1"):
        EndpointBackend([REMOTE], **kw)
    cfg = {"backend": "endpoints", "endpoints": [REMOTE], "allow_remote_endpoints": True,
           "api_key_env": "EAGLENEST_TEST_KEY"}
    with pytest.raises(ConfigError, match="^ingest.allow_plaintext_api_key: "):
        build_cfg(IngestConfig, cfg)  # refused when the recipe loads, before any engine or request
    # opted in: accepted with a warning (constructing the backend sends nothing)
    assert build_cfg(IngestConfig, {**cfg, "allow_plaintext_api_key": True}).allow_plaintext_api_key
    with caplog.at_level(logging.WARNING, logger="eaglenest.ingest.backends"):
        EndpointBackend([REMOTE], allow_plaintext_key=True, **kw)
    assert any("plain http to 10.255.255.1" in r.getMessage() and KEY not in r.getMessage() for r in caplog.records)
    # https, loopback, or no key at all need no opt-in
    EndpointBackend(["https://10.255.255.1:9"], **kw)
    EndpointBackend(["http://127.0.0.1:9"], **kw)
    EndpointBackend([REMOTE], target=str(tiny_target), allow_remote=True)


def test_bad_endpoint_urls_are_config_errors():
    for url in ("ftp://127.0.0.1:9", "http://127.0.0.1:99999", "http://[::1", "127.0.0.1:8000"):
        with pytest.raises(ConfigError, match=r"^ingest.endpoints\[0\]: .* is not an http\(s\) URL"):
            backends.check_endpoints([url], allow_remote=False)
