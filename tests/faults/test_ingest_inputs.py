"""Hostile ingest input through the real CLI: exit code 2 and one line naming the key, file and row,
no traceback, no engine, nothing written to the store (issue #10).

Every run is a subprocess of ``ingest build`` (or ``featurestore capture``) with a poisoned ``vllm``
package first on ``PYTHONPATH``: a run that gets as far as starting an engine fails loudly at once
instead of spending a minute on one. The all-requests-failed case uses the endpoints backend against
a loopback server that answers HTTP 500 to everything, so no vLLM is needed either.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eaglenest.featurestore.table import store as fs

MANIFEST = """\
name: hostile
licence: CC0-1.0
held_out_fraction: 0.0
raw_fraction: {raw}
generation:
  max_tokens: 4
domains:
  math:
    cap_prompts: 50
    sources:
      - path: {src}
        provenance: test
{extra}"""


def _manifest(tmp_path, src, *, extra: str = "", raw: float = 0.0):
    m = tmp_path / "m.yaml"
    m.write_text(MANIFEST.format(src=src, raw=raw, extra=textwrap.indent(extra, " " * 8)))
    return m


def _run(root, tmp_path, argv: list[str], *overrides: str) -> subprocess.CompletedProcess:
    poison = tmp_path / "poison" / "vllm"
    poison.mkdir(parents=True, exist_ok=True)
    (poison / "__init__.py").write_text('raise RuntimeError("test: a vLLM engine was started")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", *argv, *overrides], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def _ingest(root, tmp_path, manifest, *overrides: str) -> subprocess.CompletedProcess:
    return _run(root, tmp_path, ["eaglenest.ingest.cli", "build", "--manifest", str(manifest)],
                f"run.workdir={tmp_path / 'work'}", "ingest.max_retries=0", "ingest.retry_backoff_s=0",
                *overrides)


def _one_line(p: subprocess.CompletedProcess, prog: str = "ingest") -> str:
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-3000:])
    assert lines[0].startswith(f"{prog}: error: ") and len(lines[0]) < 400, lines[0]
    return lines[0]


def _nothing_written(tmp_path) -> None:
    assert not (tmp_path / "work").exists()


def _src(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _rows(*rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(tmp_path, name: str, rows: list[dict], *, cut: int | None = None):
    p = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), p)
    if cut:
        p.write_bytes(p.read_bytes()[:cut])
    return p


# -- unreadable sources ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,data,want", [
    ("bin.jsonl", b"\xff\xfe" + bytes(range(256)) * 4, "line 1 is not UTF-8"),
    ("u2028.jsonl", _rows({"prompt": "a"}) + b'{"prompt": "x\xe2\x80\xa8y"}\n{"prompt": "b"}\n{"prompt": 1 2}\n',
     "line 4 is not valid JSON"),
    ("latin1.jsonl", _rows({"prompt": "a"}, {"prompt": "b"}) + '{"prompt": "café"}\n'.encode("latin-1"),
     "line 3 is not UTF-8"),
    ("nul.jsonl", b"\x00" * 64, "line 1 is not valid JSON"),
    ("badline.jsonl", _rows({"prompt": "a"}) + b"\n" + b'{"prompt": "b"\n', "line 3 is not valid JSON"),
    ("latin1.json", '[{"prompt": "café"}]'.encode("latin-1"), "line 1 is not UTF-8"),
    ("object.json", b'{"prompt": "a"}', "holds an object, not a list of rows"),
    ("garbage.parquet", b"PAR1" + os.urandom(200) + b"PAR1", "is not a readable Parquet file"),
])
def test_unreadable_source_names_key_and_file(root, tmp_path, name, data, want):
    src = _src(tmp_path, name, data)
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert f"domains.math.sources[0].path: {src}" in line and want in line
    _nothing_written(tmp_path)


def test_truncated_parquet_names_key_and_file(root, tmp_path):
    src = _parquet(tmp_path, "cut.parquet", [{"prompt": f"prompt {i}"} for i in range(100)], cut=300)
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert f"domains.math.sources[0].path: {src} is not a readable Parquet file" in line
    _nothing_written(tmp_path)


# -- values that are not text ------------------------------------------------------------------------
@pytest.mark.parametrize("value,kind", [(None, "null"), ({"a": 1}, "an object"), (42, "a number"),
                                        ([1, 2], "a list"), (True, "a boolean")])
def test_prompt_that_is_not_a_string_is_refused(root, tmp_path, value, kind):
    src = _src(tmp_path, "s.jsonl", _rows({"prompt": "fine"}, {"prompt": "fine too"}, {"prompt": value}))
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert line.endswith(f"domains.math.sources[0].field: row 2 of {src}: column 'prompt' is {kind}, not a string")
    _nothing_written(tmp_path)


def test_parquet_prompt_that_is_not_a_string_is_refused(root, tmp_path):
    src = _parquet(tmp_path, "s.parquet", [{"prompt": "fine"}, {"prompt": None}])
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert f"sources[0].field: row 1 of {src}: column 'prompt' is null" in line


def test_system_prompt_must_be_text_or_null(root, tmp_path):
    src = _src(tmp_path, "s.jsonl", _rows({"prompt": "a", "system": None}, {"prompt": "b", "system": 7}))
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src, extra="system_field: system\n")))
    # row 0's null system prompt is no system prompt; row 1's number is refused
    assert f"domains.math.sources[0].system_field: row 1 of {src}: column 'system' is a number" in line
    _nothing_written(tmp_path)


@pytest.mark.parametrize("msg,kind", [({"role": "user", "content": None}, "null"),
                                      ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, "a list"),
                                      ({"role": "system", "content": 3}, "a number")])
def test_message_content_must_be_text(root, tmp_path, msg, kind):
    src = _src(tmp_path, "s.jsonl", _rows({"m": [{"role": "user", "content": "ok"}]},
                                          {"m": [msg, {"role": "user", "content": "ok"}]}))
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src, extra="messages_field: m\n")))
    assert f"domains.math.sources[0].messages_field: row 1 of {src}: message 0 ({msg['role']}) content is {kind}" \
        in line
    _nothing_written(tmp_path)


# -- nothing to ingest -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,data", [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n"), ("empty.json", b"[]")])
def test_empty_source_is_named(root, tmp_path, name, data):
    src = _src(tmp_path, name, data)
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert line == f"ingest: error: domains.math.sources[0]: {src} has no rows"
    _nothing_written(tmp_path)


def test_empty_parquet_source_is_named(root, tmp_path):
    src = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), src)
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
    assert line == f"ingest: error: domains.math.sources[0]: {src} has no rows"


def test_pool_of_blank_prompts_is_an_error_naming_the_manifest(root, tmp_path):
    src = _src(tmp_path, "s.jsonl", _rows({"prompt": "  "}, {"prompt": "\n"}, {"prompt": ""}))
    m = _manifest(tmp_path, src)
    line = _one_line(_ingest(root, tmp_path, m))
    assert line.startswith(f"ingest: error: {m}: the prompt pool is empty (3 rows read: 3 empty")
    _nothing_written(tmp_path)


# -- recipe values checked when the recipe loads -----------------------------------------------------
@pytest.mark.parametrize("override,key", [
    *((o, o.split("=")[0]) for o in ["ingest.commit_every=0", "ingest.max_in_flight=-1", "ingest.request_timeout_s=0",
                                     "ingest.request_timeout_s=-5", "ingest.max_retries=-1",
                                     "ingest.retry_backoff_s=-1", "ingest.in_flight_per_endpoint=0",
                                     "ingest.dask_workers=0"]),
    ("ingest.backend=endpoints", "ingest.endpoints"),  # and no endpoint given
])
def test_ingest_config_is_checked_before_anything_runs(root, tmp_path, override, key):
    src = _src(tmp_path, "s.jsonl", _rows({"prompt": "a"}, {"prompt": "b"}))
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src), override))
    assert line.startswith(f"ingest: error: {key}: ")
    _nothing_written(tmp_path)


# -- output directories that cannot be written -------------------------------------------------------
def _good_source(tmp_path):
    return _src(tmp_path, "s.jsonl", _rows(*({"prompt": f"prompt number {i}"} for i in range(4))))


@pytest.mark.parametrize("where", ["workdir-is-a-file", "store-under-a-file", "store-under-proc"])
def test_unwritable_workdir_or_store_fails_before_anything_runs(root, tmp_path, where, tiny_target):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory is expected\n")
    store = tmp_path / "store"
    if where == "workdir-is-a-file":
        args, key, shown = [f"run.workdir={blocker}", f"run.store={store}"], "run.workdir", blocker
    elif where == "store-under-a-file":
        args, key, shown = [f"run.store={blocker / 'store'}"], "run.store", blocker / "store"
    else:  # root may write anywhere chmod allows; nobody can create a directory in /proc
        args, key, shown = ["run.store=/proc/eaglenest-no-such-dir/store"], "run.store", "/proc/eaglenest-no-such"
    line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, _good_source(tmp_path)),
                             f"run.target={tiny_target}", *args))
    assert line.startswith(f"ingest: error: {key}: ") and str(shown)[-30:] in line
    # Nothing made beside the test's own files: no store, no workdir (the store checked before was
    # tmp_path/store in every case, a path two of the three cases never name).
    assert {p.name for p in tmp_path.iterdir()} == {"blocker", "m.yaml", "s.jsonl", "poison"}
    assert blocker.read_text().startswith("a file")


def test_capture_checks_its_workdir_before_the_engine(root, tmp_path, tiny_target):
    from eaglenest.featurestore.table import store as fs
    from eaglenest.featurestore.table.fragments import ensure_table

    uri = str(tmp_path / "store")
    ensure_table(uri, fs.PROMPTS)
    v0 = fs.latest_version(uri, fs.PROMPTS)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    p = _run(root, tmp_path, ["eaglenest.featurestore.cli", "capture"], f"run.workdir={blocker}",
             f"run.store={uri}", f"run.target={tiny_target}")
    line = _one_line(p, "featurestore")
    assert line.startswith("featurestore: error: run.workdir: cannot write to ")
    assert line.endswith("blocker/featurestore (Not a directory)")
    assert fs.latest_version(uri, fs.PROMPTS) == v0 and not fs.exists(uri, "features")


# -- every request failing ---------------------------------------------------------------------------
class _Always500(http.server.BaseHTTPRequestHandler):
    def _fail(self):
        self.send_response(500)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _fail

    def log_message(self, *args):
        pass


class _StubServer(http.server.BaseHTTPRequestHandler):
    """A stub OpenAI-style server (not vLLM): raw completions succeed unless the prompt says "fail";
    chat fails. Only its failures matter here, so its token ids are made up."""

    def _reply(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200, {"data": [{"id": "stub"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or "fail" in body.get("prompt", ""):
            return self._reply(500, {"error": "injected"})
        self._reply(200, {"choices": [{"text": "ok", "token_ids": [5, 6], "finish_reason": "stop"}],
                          "prompt_token_ids": [1, 2, 3]})

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(handler) -> str:
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_every_request_failing_exits_2_and_commits_nothing(root, tmp_path, tiny_target, serve):
    url = serve(_Always500)
    store = tmp_path / "work" / "store"
    p = _ingest(root, tmp_path, _manifest(tmp_path, _good_source(tmp_path), raw=0.5), f"run.target={tiny_target}",
                "ingest.backend=endpoints", f"ingest.endpoints=[{url}]")
    line = _one_line(p)
    assert line.startswith("ingest: error: all 4 requests failed; first error: ")
    assert f"1 attempt(s) failed; last: {url}/v1/models: HTTP 500" in line
    assert not (store / "prompts.lance").exists()
    stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    assert stats["failed"] == 4 and stats["regenerated"] == 0 and stats["prompts_table_version"] is None


def test_some_requests_failing_warn_and_keep_the_rest(root, tmp_path, tiny_target, serve):
    url = serve(_StubServer)
    src = _src(tmp_path, "s.jsonl", _rows(*({"prompt": f"good prompt {i}"} for i in range(6)),
                                          *({"prompt": f"fail prompt {i}"} for i in range(3))))
    p = _ingest(root, tmp_path, _manifest(tmp_path, src, raw=0.99), f"run.target={tiny_target}",
                "ingest.backend=endpoints", f"ingest.endpoints=[{url}]")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    stats = json.loads(p.stdout)
    assert stats["failed"] >= 3 and stats["regenerated"] >= 1
    warnings = [x for x in p.stderr.splitlines() if x.startswith("ingest: warning: ")]
    assert len(warnings) == 1 and f"{stats['failed']} of {stats['failed'] + stats['regenerated']} requests failed" \
        in warnings[0]
    # The rest are kept: the prompts table holds exactly the regenerated rows, each with its response,
    # and none of the failed requests.
    rows = fs.read(str(tmp_path / "work" / "store"), fs.PROMPTS).to_pylist()
    assert len(rows) == stats["regenerated"] > 0
    assert all(r["response_token_ids"] and r["finish_reason"] == "stop" for r in rows)
    prompts = [json.loads(r["messages_json"])[0]["content"] for r in rows]
    assert all(x.startswith("good prompt ") for x in prompts), prompts
    written = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
    failed = {f["sample_id"] for f in written["failures"]}
    assert len(failed) == stats["failed"] and not failed & {r["sample_id"] for r in rows}


# -- two ingests at once (issue 10, case 2) -----------------------------------------------------------
def test_second_ingest_is_refused_while_one_holds_the_prompts_table(root, tmp_path):
    """An ingest decides once what is missing, then regenerates it: a second one at the same time
    would regenerate and append the same prompts. It is refused before any engine, naming the first."""
    src = _src(tmp_path, "p.jsonl", _rows({"prompt": "what is 2+2"}, {"prompt": "what is 3+3"}))
    uri = str(tmp_path / "work" / "store")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from eaglenest.featurestore.table import lease
        with lease.hold(sys.argv[1], "prompts", purpose="ingest build"):
            print("HELD", flush=True)
            time.sleep(120)
        """), uri], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        line = _one_line(_ingest(root, tmp_path, _manifest(tmp_path, src)))
        assert f"being written by pid {holder.pid}" in line and "ingest build" in line
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "work" / "store" / "prompts.lance").exists()
