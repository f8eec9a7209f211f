"""Feature-store test fixtures: the helper modules on sys.path (also for subprocesses), and the
captured store the streaming tests share, a listener that drops every connection (another service)."""

import socket
import sys
import threading
from pathlib import Path

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import s3_helpers  # noqa: E402
from stream_helpers import captured_store  # noqa: E402


@pytest.fixture(scope="session")
def stream_store(tmp_path_factory, tiny_target) -> str:
    """A store with 12 conversations captured by the table path (one engine start), which the
    streaming tests stream again and compare against: several captures per rank, so a kill lands
    mid-share."""
    return captured_store(str(tmp_path_factory.mktemp("stream") / "store"), str(tiny_target), 12)


@pytest.fixture(scope="module")
def s3():
    """A local S3 stand-in (moto) for one test module, its endpoint and keys in the environment."""
    with s3_helpers.moto_s3() as server, pytest.MonkeyPatch.context() as mp:
        for k, v in server.env.items():
            mp.setenv(k, v)
        yield server


@pytest.fixture
def short_tmp(monkeypatch):
    """A fresh temp dir of a short path, also the process's temp dir: a stream's socket lives there, and
    pytest's own (``.../popen-gw1/test_<long name>0/``) leaves too few of a socket path's 107 bytes."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="en-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def dropping_listener():
    """host:port of a listener that accepts every connection and closes it at once (another service)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    done = threading.Event()

    def loop():
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.close()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    done.set()
    t.join(5)
    srv.close()
