"""Third QA pass of ``ingest``: a Dask scheduler and a target that fail before anything is written, what a
Dask worker killed by its shard is reported as, addresses and endpoint URLs a user gets wrong. Local files,
pure functions and ``ingest build`` through its CLI; no vLLM engine, no network beyond loopback."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import threading
from types import SimpleNamespace

import pytest

from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import backends, commands, dask_executor
from eaglenest.ingest import build as build_module
from eaglenest.ingest.cli import main
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connecting is refused


def _build(tmp_path, capsys, *overrides) -> tuple[int, list[str]]:
    rc = main(["build", "--recipe", "recipes/toy.yaml", f"run.workdir={tmp_path / 'work'}", *overrides])
    return rc, capsys.readouterr().err.strip().splitlines()


# -- a Dask scheduler that is not there: refused before the pool is built, leaving no store ----------------
def test_a_dead_scheduler_is_refused_before_the_pool_is_built_and_leaves_no_store(tmp_path, capsys, monkeypatch,
                                                                                  tiny_target):
    # The scheduler was reached only inside build(), after the pool was loaded (sources read, the
    # target's tokenizer loaded, contamination checked) and after run.store had been created: the
    # refusal left an empty store folder behind.
    pools = []
    real = commands.load_pool
    monkeypatch.setattr(commands, "load_pool", lambda *a, **k: pools.append(1) or real(*a, **k))
    addr = f"tcp://127.0.0.1:{_closed_port()}"
    rc, err = _build(tmp_path, capsys, f"run.target={tiny_target}", "ingest.executor=dask",
                     f"ingest.dask_scheduler={addr}")
    assert rc == 2
    assert [line for line in err if line.startswith("ingest: error: ")] == err[-1:]
    assert err[-1].startswith(f"ingest: error: ingest.dask_scheduler: cannot reach a Dask scheduler at {addr} ")
    assert pools == []
    assert not (tmp_path / "work").exists()


def test_an_inproc_scheduler_address_says_what_is_wrong_with_it():
    # distributed's own words: "not enough values to unpack (expected 3, got 1)".
    with pytest.raises(ConfigError) as info:
        dask_executor.connect("inproc://x")
    msg = str(info.value)
    assert msg.startswith("ingest.dask_scheduler: cannot reach a Dask scheduler at inproc://x (inproc:// names")
    assert "tcp://host:port" in msg and "unpack" not in msg and "\n" not in msg


# -- a shard that killed every worker: the task and the last worker are named, whole ------------------------
class _Killed:
    """A future whose shard killed every worker it ran on (what ``distributed`` reports then)."""

    def __init__(self, key: str, worker: str):
        from distributed import KilledWorker

        self.error = KilledWorker(key, SimpleNamespace(address=worker), 3)

    def result(self):
        raise self.error


class _Client:
    def __init__(self, worker: str):
        self.worker, self.keys = worker, []

    def submit(self, *args, key: str, **kwargs):
        self.keys.append(key)
        return _Killed(key, self.worker)


def test_a_shard_that_killed_every_worker_names_its_task_and_last_worker(tmp_path, monkeypatch):
    # The message kept the first 300 characters of distributed's text: with a long domain name (and
    # so a long task key) or a long worker address, the address, or the task's own name, was cut off
    # while its closing paragraph of generic advice was not.
    import distributed

    monkeypatch.setattr(distributed, "as_completed", lambda futures: list(futures))
    worker = "tcp://" + "gpu-node-0017.rack-b.cluster.example.internal" * 3 + ":40123"
    client = _Client(worker)
    shard = [SimpleNamespace(sample_id=f"{'long_domain_name_' * 12}-0123456789abcdef")]
    with pytest.raises(EaglenestError) as info:
        dask_executor.run([shard], cfg=IngestConfig(executor="dask"), target="t", store_uri=str(tmp_path / "s"),
                          gen=None, gen_id="g", on_result=lambda k, r: pytest.fail("a killed shard returned"),
                          client=client)
    msg = str(info.value)
    assert msg.startswith("ingest.executor: shard 0 killed every Dask worker that ran it (")
    assert repr(client.keys[0]) in msg and f"the last {worker}" in msg and "4 worker(s)" in msg
    assert "\n" not in msg and msg.endswith("a re-run resumes after them")


# -- endpoint URLs with an API route, a query or a fragment ---------------------------------------------------
@pytest.mark.parametrize("url, says, base", [
    ("http://127.0.0.1:8000/v1/chat", "names an API route (/v1/chat)", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1/chat/completions/", "names an API route", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/proxy/v1/models", "names an API route", "http://127.0.0.1:8000/proxy"),
    ("http://127.0.0.1:8000/v1?model=x", "has a query or fragment", "http://127.0.0.1:8000/v1"),
])
def test_an_endpoint_url_past_the_servers_base_is_refused_naming_the_key(url, says, base):
    # Every request went to <url>/v1/models and <url>/v1/chat/completions, and every one failed,
    # after retries, with HTTP 404: "all N requests failed" once an engine-less run had started.
    with pytest.raises(ConfigError) as info:
        IngestConfig(backend="endpoints", endpoints=["http://127.0.0.1:9000", url])
    msg = str(info.value)
    assert msg.startswith(f"ingest.endpoints[1]: {url} {says}") and f"base URL ({base})" in msg


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/", "http://127.0.0.1/llm"])
def test_a_base_url_a_v1_suffix_or_a_proxy_prefix_is_still_accepted(url):
    assert backends.check_endpoints([url], allow_remote=False) == [url.rstrip("/").removesuffix("/v1")]


def test_an_endpoint_url_refused_for_its_route_never_shows_its_password():
    url = "https://bob:hunter2-pass@llm.example:8443/v1/chat/completions"
    with pytest.raises(ConfigError) as info:
        backends.check_endpoints([url], allow_remote=True)
    assert "hunter2" not in str(info.value) and "names an API route" in str(info.value)


# -- a target whose config.json transformers refuses --------------------------------------------------------
def test_a_target_transformers_cannot_load_is_one_line_before_anything_is_written(tmp_path, capsys, tiny_target):
    # config.json is valid JSON of a known model type, so the target checks passed; transformers then
    # raised ZeroDivisionError loading it, after the pool was built and run.store created: a
    # traceback, exit 1, and an empty store folder left behind.
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    rc, err = _build(tmp_path, capsys, f"run.target={target}")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"ingest: error: run.target: {target}: transformers cannot load its config or tokenizer "
                             "(ZeroDivisionError: ")
    assert not (tmp_path / "work").exists()


# -- waits past what the OS's timers hold -------------------------------------------------------------------
def test_a_request_timeout_past_the_os_timers_is_refused_when_the_recipe_loads():
    # 1e10 s ("never time out") passed as finite and > 0; every request then raised OverflowError
    # from socket.settimeout, out of the backend's worker threads: a traceback, mid-run.
    with pytest.raises(ConfigError, match=r"^ingest\.request_timeout_s: 10000000000\.0 must be a number in \(0, 86400"):
        IngestConfig(request_timeout_s=1e10)
    assert IngestConfig(request_timeout_s=86400).request_timeout_s == 86400


def test_retries_whose_backoff_would_wait_for_ever_are_refused_naming_the_keys():
    # 0.5 * 2**39 s slept before the 40th retry (OverflowError in time.sleep, or days of waiting).
    with pytest.raises(ConfigError) as info:
        IngestConfig(max_retries=40)
    msg = str(info.value)
    assert msg.startswith("ingest.retry_backoff_s: the last of 40 retries would wait 2.75e+11 s ")
    assert msg.endswith("lower ingest.retry_backoff_s or ingest.max_retries")
    assert IngestConfig(max_retries=17).max_retries == 17  # 0.5 * 2**16 s: under a day
    assert IngestConfig(max_retries=5000, retry_backoff_s=0).max_retries == 5000


# -- an evaluation file with no prompt in it ---------------------------------------------------------------
@pytest.mark.parametrize("data", ["", "\n\n", '{"turns": []}\n{"messages": [{"role": "assistant", "content": "a"}]}\n'])
def test_an_evaluation_file_without_a_prompt_is_refused_naming_the_key(tmp_path, capsys, data):
    # An empty MT-Bench copy (a download that failed into an empty file) passed `ingest validate` and
    # `ingest build`: the contamination check compared the pool with nothing and reported it clean.
    (tmp_path / "question.jsonl").write_text(data)
    (tmp_path / "s.jsonl").write_text('{"prompt": "What is two plus two?"}\n')
    (tmp_path / "m.yaml").write_text(f"name: t\nlicence: x\ncontamination:\n"
                                     f"  mt_bench: [{tmp_path / 'question.jsonl'}]\n"
                                     f"domains:\n  a:\n    cap_prompts: 5\n    sources:\n"
                                     f"      - path: {tmp_path / 's.jsonl'}\n        provenance: p\n")
    rc = main(["validate", "--recipe", "recipes/toy.yaml", "--manifest", str(tmp_path / "m.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2, err
    assert err[0].startswith(f"contamination.mt_bench[0]: {tmp_path / 'question.jsonl'} holds no evaluation prompt")


# -- a re-run whose manifest no longer chooses stored prompts ------------------------------------------------
def test_a_rerun_whose_manifest_drops_stored_prompts_says_they_stay(tmp_path, capsys, monkeypatch, tiny_target):
    # Lowering cap_prompts (or removing a source row or a domain) under the same manifest name left the
    # prompts chosen before in the table, to be captured and trained on, without a word: the table's pool
    # was neither the old manifest's nor the new one's.
    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    monkeypatch.setattr(build_module, "make_backend", lambda *args, **kwargs: backend)
    src = tmp_path / "s.jsonl"
    src.write_text("".join(f'{{"prompt": "question number {i}"}}\n' for i in range(6)))
    text = ("name: t\nlicence: x\nraw_fraction: 0.0\nheld_out_count: 0\ndomains:\n  a:\n    cap_prompts: {cap}\n"
            f"    sources:\n      - path: {src}\n        provenance: p\n")
    runs = []
    for cap in (6, 2, 6):
        (tmp_path / "m.yaml").write_text(text.format(cap=cap))
        rc, err = _build(tmp_path, capsys, "--manifest", str(tmp_path / "m.yaml"), f"run.target={tiny_target}")
        stats = json.loads((tmp_path / "work" / "ingest" / "stats.json").read_text())
        runs.append((rc, [line for line in err if "not in this manifest's pool" in line], stats["not_in_pool"]))
    assert len(store.sample_ids(str(tmp_path / "work" / "store"), store.PROMPTS)) == 6 == len(backend.requests)
    assert [rc for rc, _, _ in runs] == [0, 0, 0]
    assert runs[0][1:] == runs[2][1:] == ([], {"prompts": 0, "per_domain": {}})
    assert runs[1][2] == {"prompts": 4, "per_domain": {"a": 4}}
    assert len(runs[1][1]) == 1 and runs[1][1][0].startswith("ingest: warning: 4 stored prompt(s) ({'a': 4}) are ")


# -- an endpoint that does not speak HTTP, or cuts its answer off -------------------------------------------
class _CutOff(http.server.BaseHTTPRequestHandler):
    """Lists a model, then answers a completion with fewer bytes than its Content-Length promises."""

    def do_GET(self):
        body = b'{"data": [{"id": "m"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"choices": [')
        self.close_connection = True

    def log_message(self, *args):
        pass


def _banner_server(stop: threading.Event) -> socket.socket:
    """A loopback port that answers any request with an SSH banner (a wrong port in ingest.endpoints)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    threading.Thread(target=serve, daemon=True).start()
    return srv


@pytest.mark.parametrize("server, says", [("banner", "/v1/models: BadStatusLine"),
                                          ("cut_off", "/v1/completions: IncompleteRead: ")])
def test_an_endpoint_answering_without_http_is_a_failed_request_not_a_traceback(tiny_target, server, says):
    # http.client's HTTPException (BadStatusLine, IncompleteRead) is no OSError: it left the request's
    # thread uncaught and ended `ingest build` with a traceback instead of a failure retried and reported.
    stop = threading.Event()
    if server == "banner":
        srv = _banner_server(stop)
        url, close = f"http://127.0.0.1:{srv.getsockname()[1]}", srv.close
    else:
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CutOff)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url, close = f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown
    backend = backends.EndpointBackend([url], target=str(tiny_target), max_retries=1, backoff_s=0, timeout_s=10)
    try:
        backend.submit("k", "raw", "hello", Generation())
        ((key, result),) = backend.poll()
    finally:
        backend.close()
        stop.set()
        close()
    assert key == "k" and isinstance(result, backends.Failure)
    assert result.error.startswith(f"2 attempt(s) failed; last: {url}{says}"), result.error


def test_a_build_on_a_running_scheduler_uses_the_client_it_checked_first(tmp_path, capsys, monkeypatch, tiny_target):
    # The scheduler is now reached before the pool is built, and that client runs the shards (one
    # connection, closed at the end). Threads in this process, a scripted backend: bookkeeping only.
    import distributed

    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    monkeypatch.setattr(dask_executor, "make_backend", lambda *args, **kwargs: backend)
    monkeypatch.setattr(dask_executor, "check_worker", lambda *args: None)  # the worker is a thread of this process
    src = tmp_path / "s.jsonl"
    src.write_text("".join(f'{{"prompt": "question number {i}"}}\n' for i in range(5)))
    (tmp_path / "m.yaml").write_text("name: t\nlicence: x\nraw_fraction: 0.0\nheld_out_count: 1\ndomains:\n  a:\n"
                                     f"    cap_prompts: 9\n    sources:\n      - path: {src}\n        provenance: p\n")
    connected = []
    real = dask_executor.connect
    monkeypatch.setattr(dask_executor, "connect", lambda address: connected.append(real(address)) or connected[-1])
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                                  protocol="tcp", host="127.0.0.1") as cluster:
        rc, err = _build(tmp_path, capsys, "--manifest", str(tmp_path / "m.yaml"), f"run.target={tiny_target}",
                         "ingest.executor=dask", f"ingest.dask_scheduler={cluster.scheduler_address}",
                         "ingest.commit_every=2")
    assert rc == 0, err
    assert len(connected) == 1 and connected[0].status == "closed"
    ids = store.sample_ids(str(tmp_path / "work" / "store"), store.PROMPTS)
    assert len(ids) == len(set(ids)) == 5 and len(backend.requests) == 4


def test_a_scheduler_address_without_the_dask_executor_is_warned_of(tmp_path, capsys, monkeypatch, tiny_target):
    # README lists `ingest.dask_scheduler=tcp://HOST:8786` as "regenerate on a running cluster"; alone it
    # was ignored without a word and the engine started in this process (a login node, no GPU).
    backend = Scripted(load_tokenizer(str(tiny_target), trust_remote_code=False))
    monkeypatch.setattr(build_module, "make_backend", lambda *args, **kwargs: backend)
    src = tmp_path / "s.jsonl"
    src.write_text('{"prompt": "question number 1"}\n{"prompt": "question number 2"}\n')
    (tmp_path / "m.yaml").write_text("name: t\nlicence: x\nheld_out_count: 0\ndomains:\n  a:\n    cap_prompts: 9\n"
                                     f"    sources:\n      - path: {src}\n        provenance: p\n")
    addr = f"tcp://127.0.0.1:{_closed_port()}"  # never contacted: the in-process executor runs
    rc, err = _build(tmp_path, capsys, "--manifest", str(tmp_path / "m.yaml"), f"run.target={tiny_target}",
                     f"ingest.dask_scheduler={addr}")
    assert rc == 0 and len(backend.requests) == 2
    warned = [line for line in err if "ingest.dask_scheduler" in line]
    assert warned == [f"ingest: warning: ingest.dask_scheduler is {addr} but ingest.executor is inprocess: this build "
                      "runs in this process, not on the cluster; add ingest.executor=dask to use it"]
