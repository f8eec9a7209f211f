"""The cross-host stream's address, hostile pass 12: what a user types for ``train.stream.addr`` or
stream-serve ``--addr`` that is no ``host:port``. A URL (``tcp://HOST:PORT``, as a Dask scheduler's
address is written) was called "not an IPv6 address"; a mistyped IPv4 address (``10.0.0.256``) passed
as a host name, and an engine host then retried it for ``--timeout-s`` (30 min by default) as a name
"not published yet" before failing. Both are one line naming the key, at once. No network is reached."""

from __future__ import annotations

import time

import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.stream.xhost import Group

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("addr, problem", [
    ("tcp://10.0.0.5:29650", "not a URL"),
    ("http://[::1]:29650", "not a URL"),
    ("10.0.0.256:29650", "'10.0.0.256' is not an IPv4 address"),
    ("1.2.3.4.5:29650", "'1.2.3.4.5' is not an IPv4 address"),
    ("300.1.1.1:80", "'300.1.1.1' is not an IPv4 address"),
])
def test_a_url_or_a_mistyped_ipv4_address_is_one_line_naming_the_key(addr, problem):
    with pytest.raises(ConfigError) as err:
        parse_addr(addr, "--addr")
    msg = str(err.value)
    assert msg.startswith("--addr: ") and problem in msg and "\n" not in msg, msg


@pytest.mark.parametrize("addr, host", [("10.0.0.5:29650", "10.0.0.5"), ("127.1:80", "127.1"),
                                        ("node-1.cluster.local:29650", "node-1.cluster.local"),
                                        ("10-0-0-5.pod:29650", "10-0-0-5.pod"), ("[::1]:29650", "::1")])
def test_addresses_and_names_the_resolver_takes_still_pass(addr, host):
    assert parse_addr(addr) == (host, int(addr.rpartition(":")[2]))


def test_an_engine_host_given_a_mistyped_ipv4_address_fails_at_once():
    """What stream-serve builds: it waited --timeout-s for the name to resolve, then failed as unreachable."""
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^--addr: host '10\.0\.0\.256' is not an IPv4 address"):
        Group("10.0.0.256:29650", is_master=False, timeout_s=20.0, who="engine 0", key="--addr")
    assert time.monotonic() - t0 < 5
