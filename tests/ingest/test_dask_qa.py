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

from eaglenest.errors import ConfigError, EaglenestError
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
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
