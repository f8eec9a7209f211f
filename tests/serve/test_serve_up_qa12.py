"""``serve up``: a host that is no address of this machine is named as the host, not as a busy port (no
engine); the wait for the server's /health goes to the server, not to a proxy of the environment (a
stand-in server); and a real server stopped by another process is exit 2, not a clean end (``slow``)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from eaglenest.errors import EaglenestError
from eaglenest.recipe import load_recipe
from eaglenest.serve.cli import main as serve_main
from eaglenest.serve.commands import up_server
from eaglenest.serve.server import Server

#: TEST-NET-1 (RFC 5737): documentation addresses, never an address of this machine.
NOT_LOCAL = "192.0.2.1"


def _recipe(root, work, *overrides):
    return load_recipe(root / "recipes" / "toy.yaml", [f"run.workdir={work}", *overrides])


@pytest.mark.parametrize("port", [0, 8123])
def test_a_host_that_is_not_this_machines_names_the_host(root, tmp_path, port):
    with pytest.raises(EaglenestError, match=rf"^serve.host: {NOT_LOCAL} is not an address of this machine") as err:
        up_server(_recipe(root, tmp_path, f"serve.host={NOT_LOCAL}", f"serve.port={port}"), no_spec=True)
    assert "serve.port" not in str(err.value)  # the port is not what to change


def test_serve_up_on_a_host_that_is_not_this_machines_is_one_line(capsys, root, tmp_path):
    code = serve_main(["up", f"--recipe={root / 'recipes' / 'toy.yaml'}", f"run.workdir={tmp_path}", "--no-spec",
                       f"serve.host={NOT_LOCAL}"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("serve: error: serve.host: "), lines
    assert not (tmp_path / "serve").exists()  # nothing started, no log written


#: Stand-in for vLLM's API server where only the wait for ``/health`` is under test (named so): answers
#: 200 on the port it is given, as vLLM's server does once up.
HEALTHY_SERVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    HTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
""")


def test_a_proxy_in_the_environment_does_not_hide_the_local_server(monkeypatch, tmp_path, tiny_target):
    """A cluster's HTTP_PROXY (no NO_PROXY for loopback) sent the wait for /health to the proxy, which
    cannot reach this machine's server: a server that was up read as never healthy."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # the discard port: nothing proxies there
    server = Server(str(tiny_target), log_dir=tmp_path, startup_timeout_s=20)
    server.argv = [sys.executable, "-c", HEALTHY_SERVER, "127.0.0.1", str(server.port)]
    with server:
        assert server.proc.poll() is None
    assert server.proc.returncode is not None  # stopped on the way out
