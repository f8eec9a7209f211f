"""QA of ``ingest build`` after the pool: a damaged record of earlier drops, and a shard write that fails
on a Dask worker. No vLLM engine: the Dask case runs its workers as threads of this process
(``LocalCluster(processes=False)``) against a stub OpenAI-style server (not vLLM; only raw completions,
with made-up token ids), since what is tested is the executor's error path, not generation."""

from __future__ import annotations

import dataclasses
import http.server
import json
import os
import shutil
import threading

import pytest

from eaglenest.config import build as build_cfg
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import build as build_module
from eaglenest.ingest import shard
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Manifest, Source
from eaglenest.ingest.pool import PoolEntry, build_pool, load_source
from eaglenest.ingest.regen import gen_params_id


def _manifest() -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 4},
                                "domains": {"d": {"cap_prompts": 50, "sources": [{"path": "x", "provenance": "p"}]}}})


def _entries(n: int, split: str, mode: str = "chat") -> list[PoolEntry]:
    return [PoolEntry(sample_id=f"d-{split}{i:04d}", domain="d", source="s", split=split, mode=mode, system="",
                      prompt=f"prompt number {i}") for i in range(n)]


@pytest.mark.parametrize("damaged", [5, None, 1.5])
def test_a_damaged_record_of_earlier_drops_is_ignored_not_a_crash(tmp_path, tiny_target, damaged):
    # thinking_truncated.json holding {gen_params_id: <not an object>} (edited by hand, another tool's
    # file) crashed the build with a TypeError traceback (`sample_id in 5`).
    m = _manifest()
    gen_id = gen_params_id(m.generation, load_tokenizer(str(tiny_target), trust_remote_code=False).chat_template or "")
    dropped = tmp_path / "work" / "ingest" / "thinking_truncated.json"
    dropped.parent.mkdir(parents=True)
    dropped.write_text(json.dumps({gen_id: damaged}))
    pool = _entries(3, "heldout")  # held-out rows only: written without an engine
    stats = build(m, pool, target=str(tiny_target), store_uri=str(tmp_path / "store"), cfg=IngestConfig(),
                  dropped_path=dropped)
    assert stats["heldout_written"] == 3 and stats["thinking_truncated"]["skipped_from_earlier_runs"] == 0
    assert sorted(store.sample_ids(str(tmp_path / "store"), store.PROMPTS)) == [e.sample_id for e in pool]


class _StubCompletions(http.server.BaseHTTPRequestHandler):
    """A stub OpenAI-style server (not vLLM): every raw completion answers "ok" with made-up ids."""

    def _reply(self, body: dict):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"data": [{"id": "stub"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._reply({"choices": [{"text": "ok", "token_ids": [5, 6], "finish_reason": "stop"}],
                     "prompt_token_ids": [1, 2, 3]})

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_url():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StubCompletions)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_shard_write_that_fails_on_a_dask_worker_is_one_line(tmp_path, tiny_target, stub_url, monkeypatch):
    # In process a failed write (disk full) was one StoreError line; under Dask the worker's OSError
    # reached the driver as it was, and the CLI printed a traceback.
    import distributed  # heavy: imported where used

    def disk_full(store_uri, rows):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard, "write_rows", disk_full)
    cfg = build_cfg(IngestConfig, {"executor": "dask", "backend": "endpoints", "endpoints": [stub_url],
                                   "commit_every": 2, "max_retries": 0})
    uri = str(tmp_path / "store")
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)
    with cluster, distributed.Client(cluster) as client:
        with pytest.raises(StoreError) as exc:
            build(_manifest(), _entries(4, "train", mode="raw"), target=str(tiny_target), store_uri=uri, cfg=cfg,
                  client=client)
    assert str(exc.value) == (f"run.store: cannot write the prompts table in {uri}: [Errno 28] No space left on "
                              "device; no partial version was committed")
    assert not store.exists(uri, store.PROMPTS)


def test_a_target_without_a_chat_template_is_refused_before_an_engine_starts(tmp_path, tiny_target, monkeypatch):
    # vLLM refused every chat request of such a target one by one (ChatTemplateResolutionError), after
    # an engine start, on every run: each re-run retried them and failed the same way.
    target = tmp_path / "base-model"
    shutil.copytree(tiny_target, target)
    cfg_path = target / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(build_module, "make_backend", no_engine)
    pool = _entries(3, "train") + _entries(1, "heldout")
    uri = str(tmp_path / "store")
    with pytest.raises(ConfigError) as exc:
        build(_manifest(), pool, target=str(target), store_uri=uri, cfg=IngestConfig())
    assert str(exc.value) == (f"run.target: {target} has no chat template, and 3 training prompts are chat; "
                              "give its tokenizer one (chat_template in tokenizer_config.json or "
                              "chat_template.jinja)")
    assert not store.exists(uri, store.PROMPTS)  # refused before anything was written


def test_a_source_file_name_that_is_not_utf8_is_stored_without_a_crash(tmp_path, tiny_target):
    # A file name with a byte that is not UTF-8 (Python spells it as a lone surrogate) went into every
    # row's `source`; Arrow refused it when the rows were written (UnicodeEncodeError traceback),
    # after regeneration. The label keeps the byte visible as an escape.
    name = os.fsdecode(os.fsencode(str(tmp_path)) + b"/caf\xe9.jsonl")
    with open(name, "w", encoding="utf-8") as f:
        f.write('{"prompt": "what is one plus one"}\n{"prompt": "name two colours"}\n')
    rows = load_source(Source(path=name), where="domains.d.sources[0]")
    assert {r["source"] for r in rows} == {f"{tmp_path}/caf\\udce9.jsonl"}
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "held_out_count": 5,
                             "domains": {"d": {"cap_prompts": 5, "sources": [{"path": name, "provenance": "p"}]}}})
    pool = build_pool(m, {"d": rows})
    uri = str(tmp_path / "store")
    stats = build(m, pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig())
    assert stats["heldout_written"] == 2
    stored = store.read(uri, store.PROMPTS, columns=["source"]).column("source").to_pylist()
    assert stored == [f"{tmp_path}/caf\\udce9.jsonl"] * 2


def test_a_conversation_the_targets_template_refuses_is_one_line_not_a_traceback(tmp_path, tiny_target):
    """The endpoint backend re-renders the first conversation of each server with the target's own
    template; a template that raises (jinja's raise_exception, here on every input) was a traceback."""
    from eaglenest.ingest.backends import Completion, EndpointBackend
    from eaglenest.ingest.manifest import Generation

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    assert "chat_template" in cfg  # the tiny target keeps its template there
    cfg["chat_template"] = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    backend = EndpointBackend(["http://127.0.0.1:9"], target=str(target))
    done = Completion([1, 2], [3], "x", "stop")
    with pytest.raises(ConfigError) as exc:
        backend._check_template("http://127.0.0.1:9", [{"role": "user", "content": "hi"}], done, Generation())
    line = str(exc.value)
    assert line.startswith("ingest.endpoints: http://127.0.0.1:9 rendered a conversation the target ")
    assert "roles must alternate" in line and "\n" not in line


def test_a_renamed_domain_is_refused_not_stored_twice(tmp_path, tiny_target):
    """Sample ids are ``<domain>-<content hash>``: the same prompts under a renamed domain got new ids and
    were stored a second time. Held-out rows only: written without an engine."""
    m, uri = _manifest(), str(tmp_path / "store")
    first = _entries(3, "heldout")
    build(m, first, target=str(tiny_target), store_uri=uri, cfg=IngestConfig())
    renamed = [dataclasses.replace(e, domain="d-renamed", sample_id=e.sample_id.replace("d-", "d-renamed-", 1))
               for e in first]
    assert all(e.sample_id.rsplit("-", 1)[1] == f.sample_id.rsplit("-", 1)[1] for e, f in zip(renamed, first,
                                                                                                strict=True))
    with pytest.raises(ConfigError, match=r"^manifest: 3 prompt\(s\) of domain 'd-renamed' are stored already under "
                                          r"domain 'd' "):
        build(m, renamed, target=str(tiny_target), store_uri=uri, cfg=IngestConfig())
    assert sorted(store.sample_ids(uri, store.PROMPTS)) == sorted(e.sample_id for e in first)  # nothing added
    again = build(m, first, target=str(tiny_target), store_uri=uri, cfg=IngestConfig())  # the old name: nothing to do
    assert again["heldout_written"] == 0
