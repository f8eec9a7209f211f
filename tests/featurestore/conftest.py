"""Feature-store test fixtures: the helper modules on sys.path (also for subprocesses), and the
captured store the streaming tests share."""

import sys
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
