"""The cross-host stream's address, hostile pass 9: trainer rank 0 hosts the stream's store at
``train.stream.addr``, so an address that is not this host's (a typo, node 1's address, a name that does not
resolve) is one line naming the key, the address and what to set, in seconds: the store's own client retried
it for ``train.stream.timeout_s`` (30 min by default) and then failed with a bind error naming neither the key
nor the cause. A name that does not resolve is refused at once; an address of another host after a few seconds
(a port forwarded to this host, a container's, answers at once there). No engine; no network is reached
(192.0.2.1 is TEST-NET-1, ``.invalid`` never resolves)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.stream.xhost import Group, RankStream
from eaglenest.train.stream_source import StreamShards

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("host, why", [("192.0.2.1", "is not an address of this host"),
                                       ("no-such-host.invalid", "cannot resolve")])
def test_rank_0_at_an_address_not_of_this_host_fails_in_seconds_naming_the_key(host, why):
    addr = f"{host}:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        Group(addr, is_master=True, timeout_s=600.0, who="rank 0")  # the default wait would be 10 min
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert msg.startswith("train.stream.addr: ") and host in msg and why in msg, msg
    assert "set train.stream.addr" in msg and "\n" not in msg, msg


def test_the_trainers_rank_0_refuses_it_before_its_share_is_published():
    """What a trainer rank builds (RankStream): the same line, before the group is waited for."""
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"train\.stream\.addr: .*192\.0\.2\.1.* is not an address of this host"):
        RankStream(f"192.0.2.1:{_free_port()}", rank=0, world_size=1, num_engines=1, spec={}, sequences=[[1, 2]],
                   steps=[0], depth=2, timeout_s=600.0)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()])
def test_rank_0_still_hosts_at_its_own_names_and_addresses(host):
    """The check takes every address of this host (a loopback, the wildcard, its own name)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        pytest.skip(f"{host!r} does not resolve on this machine")  # a container without its own name
    group = Group(f"{host}:{_free_port()}", is_master=True, timeout_s=30.0, who="rank 0")
    try:
        group.store.set("k", "v")
        assert group.store.get("k") == b"v"
    finally:
        del group


#: A trainer rank 0 as a process of its own: torch imported as a trainer does (its C++ log at the default level).
_RANK_0 = """
import sys
import torch
from eaglenest.errors import EaglenestError
from eaglenest.featurestore.stream.xhost import RankStream

try:
    RankStream(sys.argv[1], rank=0, world_size=2, num_engines=1, spec={}, sequences=[[1, 2]], steps=[0], depth=2,
               timeout_s=1800)
except EaglenestError as exc:
    print(f"train: error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_rank_0_process_says_it_in_one_line_and_no_cpp_stack():
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "RANK", "WORLD_SIZE")}
    addr = f"192.0.2.1:{_free_port()}"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _RANK_0, addr], capture_output=True, text=True, timeout=120,
                       env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"train: error: train.stream.addr: {addr}: "), lines
    assert time.monotonic() - t0 < 60


def test_a_second_trainer_on_the_same_port_is_told_to_pick_a_free_one():
    """Two jobs given one train.stream.addr on one host: the second's rank 0 cannot host the store; its line
    said only what the socket said (EADDRINUSE), not which key to change."""
    addr = f"127.0.0.1:{_free_port()}"
    first = Group(addr, is_master=True, timeout_s=30.0, who="rank 0")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError) as err:
            Group(addr, is_master=True, timeout_s=600.0, who="rank 0")
        assert time.monotonic() - t0 < 10
        msg = str(err.value)
        assert msg.startswith(f"capture stream (rank 0): cannot bind the stream store at {addr}: "), msg
        assert f"port {addr.rpartition(':')[2]} is in use on this host" in msg, msg
        assert "set train.stream.addr to a free port" in msg and "\n" not in msg, msg
        assert first.store.set("k", "v") is None  # the first job's store is untouched
    finally:
        del first


def test_the_trainers_data_source_refuses_it_before_it_reads_anything(tmp_path, monkeypatch):
    """`train run` / `train launch` (RANK 0): a name that does not resolve is refused where the stream source is
    opened, before the prompts table or the target are read (here there is none: the address is the one line)."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match=r"^train\.stream\.addr: no-such-host\.invalid:\d+: cannot resolve host"):
        StreamShards(str(tmp_path / "no-store"), featurestore=FeaturestoreConfig(), target="no-target", split="train",
                     pack_tokens=64, batch_rows=1, seed=0, depth=2, transport="gloo", engines=1,
                     addr=f"no-such-host.invalid:{_free_port()}")
    monkeypatch.setenv("RANK", "1")  # a rank that only reaches the store: its address is rank 0's, checked there
    with pytest.raises(StoreError, match="no prompts table"):
        StreamShards(str(tmp_path / "no-store"), featurestore=FeaturestoreConfig(), target="no-target", split="train",
                     pack_tokens=64, batch_rows=1, seed=0, depth=2, transport="gloo", engines=1,
                     addr=f"no-such-host.invalid:{_free_port()}")
