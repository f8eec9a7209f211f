"""Scheduler addresses a user gets wrong, beyond a closed port (test_dask_cluster.py): a port that
accepts and says nothing (a dashboard, another service) and a scheme whose settings are missing.
Each is one ConfigError line naming the key and the address, in bounded time, before any write."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eaglenest.errors import ConfigError, EaglenestError, StoreError
from eaglenest.ingest import dask_executor
from eaglenest.ingest.config import IngestConfig


@pytest.mark.timeout(60)
def test_silent_port_fails_within_the_connect_timeout(monkeypatch):
    """distributed's handshake read has no timeout: Client hung for ever on such a port."""
    monkeypatch.setattr(dask_executor, "CONNECT_TIMEOUT_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        addr = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            dask_executor.connect(addr)
    msg = str(info.value)
    assert msg.startswith(f"ingest.dask_scheduler: cannot reach a Dask scheduler at {addr} ")
    assert "sent no Dask handshake" in msg and "\n" not in msg
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_port_that_hangs_up_names_the_handshake(monkeypatch):
    with socket.socket() as rude:
        rude.bind(("127.0.0.1", 0))
        rude.listen(4)
        addr = f"tcp://127.0.0.1:{rude.getsockname()[1]}"
        # A client that connects is accepted and dropped at once, before it reads anything.
        monkeypatch.setattr(dask_executor.socket, "create_connection", _connect_then_peer_closes(rude))
        with pytest.raises(ConfigError, match=f"at {addr} .*closed the connection without a Dask handshake"):
            dask_executor.connect(addr)


def _connect_then_peer_closes(listener):
    real = socket.create_connection

    def connect(host_port, timeout=None):
        sock = real(host_port, timeout=timeout)
        listener.accept()[0].close()
        return sock
    return connect


def test_tls_scheduler_without_tls_settings_is_one_line():
    """tls:// with no distributed.comm.tls settings raised distributed's TypeError, a traceback."""
    with pytest.raises(ConfigError) as info:
        dask_executor.connect("tls://127.0.0.1:1")
    msg = str(info.value)
    assert msg.startswith("ingest.dask_scheduler: cannot reach a Dask scheduler at tls://127.0.0.1:1 ")
    assert "ssl_context" in msg and "\n" not in msg


@pytest.mark.timeout(120)
def test_scheduler_lost_mid_run_is_one_line(tmp_path, tiny_target):
    """Every pending shard is cancelled when the scheduler dies: distributed's FutureCancelledError
    came out of ``run`` as a traceback."""
    import distributed

    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    sched = subprocess.Popen([str(Path(sys.executable).parent / "dask"), "scheduler", "--host", "127.0.0.1",
                              "--port", str(port), "--no-dashboard"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        client = _wait_for_scheduler(distributed, addr)
        # No workers: the shards stay pending until the scheduler is killed under them.
        threading.Timer(2.0, os.killpg, (sched.pid, signal.SIGKILL)).start()
        shards = [[SimpleNamespace(sample_id=f"s{k}")] for k in range(2)]
        with pytest.raises(EaglenestError) as info:
            dask_executor.run(shards, cfg=IngestConfig(), target=str(tiny_target), store_uri=str(tmp_path / "store"),
                              gen=None, gen_id="g", on_result=lambda k, r: None, client=client)
        msg = str(info.value)
        assert msg.startswith("ingest.dask_scheduler: lost the Dask scheduler during shard ")
        assert "scheduler-connection-lost" in msg and "\n" not in msg
        client.close(timeout=5)
    finally:
        try:
            os.killpg(sched.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sched.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_scheduler(distributed, addr: str):
    deadline = time.monotonic() + 60
    while True:
        try:
            return distributed.Client(addr, timeout=5)
        except (OSError, AssertionError):  # AssertionError: distributed's IO-loop thread took > 10 s to start
            if time.monotonic() > deadline:  # (a loaded 2-core machine; seen once in a fresh-clone run)
                raise
            time.sleep(0.5)


@pytest.mark.timeout(120)
def test_two_builds_on_one_cluster_each_get_their_own_shard(tmp_path, monkeypatch):
    """Task keys are global to a scheduler: a shard's key was its index and first sample id only, so
    a second build of the same prompts into another store (another target, a concurrent re-run) got
    the first build's result: fragments written under the first store, committed into the second."""
    import distributed

    def fake_shard(backend, store_uri, entries, gen, gen_id, think=None):
        return {"store": store_uri, "gen_id": gen_id, "fragments": [], "rows": len(entries), "failures": []}

    monkeypatch.setattr(dask_executor, "check_worker", lambda cfg, target, store_uri: None)
    monkeypatch.setattr(dask_executor, "_backend", lambda cfg, target, trust_remote_code: None)
    monkeypatch.setattr(dask_executor, "run_shard", fake_shard)
    shards = [[SimpleNamespace(sample_id="d-same")]]
    got = {}

    def first_done(k, res):  # the first build's shard is still held while the second build runs
        got["first"] = res
        dask_executor.run(shards, cfg=IngestConfig(), target="t", store_uri=str(tmp_path / "b"), gen=None,
                          gen_id="g2", on_result=lambda k, r: got.setdefault("second", r), client=client)

    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as client:
        dask_executor.run(shards, cfg=IngestConfig(), target="t", store_uri=str(tmp_path / "a"), gen=None,
                          gen_id="g1", on_result=first_done, client=client)
    assert (got["first"]["store"], got["first"]["gen_id"]) == (str(tmp_path / "a"), "g1")
    assert (got["second"]["store"], got["second"]["gen_id"]) == (str(tmp_path / "b"), "g2")


def test_worker_that_cannot_see_a_file_uri_store_is_refused(tmp_path, tiny_target):
    """``file:///x`` is a local store (docs/storage.md), but the worker check took it for an object store:
    a worker without the shared filesystem wrote the shard to its own disk and the driver committed it."""
    with pytest.raises(StoreError) as info:
        dask_executor.check_worker(IngestConfig(), str(tiny_target), "file:///nowhere/store")
    assert str(info.value).startswith("run.store: file:///nowhere/store is not visible on Dask worker ")
    dask_executor.check_worker(IngestConfig(), str(tiny_target), f"file://{tmp_path}")  # one it sees: fine


@pytest.mark.timeout(120)
def test_a_new_file_uri_store_is_created_before_the_workers_check_it(tmp_path, monkeypatch):
    import distributed

    seen = []
    monkeypatch.setattr(dask_executor, "_backend", lambda cfg, target, trust_remote_code: None)
    monkeypatch.setattr(dask_executor, "run_shard", lambda backend, store_uri, entries, gen, gen_id, think=None:
                        seen.append(store_uri) or {"fragments": [], "rows": 0, "failures": []})
    uri = f"file://{tmp_path}/new-store"
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=1, dashboard_address=None) as client:
        dask_executor.run([[SimpleNamespace(sample_id="d-x")]], cfg=IngestConfig(), target="t",
                          store_uri=uri, gen=None, gen_id="g", on_result=lambda k, r: None, client=client)
    assert (tmp_path / "new-store").is_dir() and seen == [uri]


@pytest.mark.timeout(120)
def test_shard_that_kills_every_worker_is_one_line(tmp_path, monkeypatch, tiny_target):
    """docs/ingest.md: a shard that kills allowed-failures + 1 workers stops the build with one line
    (here allowed-failures=0: the first SIGKILL, as the OOM killer would, ends it)."""
    import dask
    import distributed

    marks = tmp_path / "started"
    marks.mkdir()
    monkeypatch.setenv("EAGLENEST_TEST_SHARD_STARTED", str(marks))  # the worker processes inherit it
    stop = threading.Event()

    def killer():  # SIGKILL each worker process as soon as it starts the shard
        while not stop.is_set():
            for f in marks.iterdir():
                f.unlink()
                os.kill(int(f.name.split("-", 1)[0]), signal.SIGKILL)
            time.sleep(0.02)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    try:
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
                distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                         host="127.0.0.1") as cluster, distributed.Client(cluster) as client:
            with pytest.raises(EaglenestError) as info:
                dask_executor.run([[SimpleNamespace(sample_id="d-kills")]], cfg=IngestConfig(), target=str(tiny_target),
                                  store_uri=str(tmp_path / "store"), gen=None, gen_id="g",
                                  on_result=lambda k, r: pytest.fail("a killed shard returned"), client=client)
    finally:
        stop.set()
        th.join()
    msg = str(info.value)
    assert msg.startswith("ingest.executor: shard 0 killed every Dask worker that ran it (") and "\n" not in msg
    assert "ingest-shard-0-d-kills-" in msg and msg.endswith("a re-run resumes after them")


def test_worker_restarts_its_engine_when_the_target_is_replaced_in_place(tmp_path, monkeypatch):
    """A worker keeps its engine for later builds with the same settings and target path: new weights
    copied over that path were served by the old engine, under the new target's id in the lineage."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old weights")
    started, closed = [], []

    class Backend:
        def close(self):
            closed.append(self)

    monkeypatch.setattr(dask_executor, "make_backend", lambda cfg, target, trust_remote_code: started.append(
        Backend()) or started[-1])
    monkeypatch.setattr(dask_executor, "_BACKENDS", {})
    cfg = IngestConfig(backend="endpoints", endpoints=["http://127.0.0.1:1"])  # no reaper: not an engine here
    first = dask_executor._backend(cfg, str(target), False)
    assert dask_executor._backend(cfg, str(target), False) is first  # same target: kept warm
    (target / "model.safetensors").write_bytes(b"new weights, other size")
    second = dask_executor._backend(cfg, str(target), False)
    assert second is not first and closed == [first] and len(started) == 2
