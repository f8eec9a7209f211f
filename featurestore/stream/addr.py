"""The cross-host stream's address: ``host:port`` of the TCPStore that trainer rank 0 hosts, and
the most captures a stream grants in flight.

Apart from :mod:`eaglenest.featurestore.stream.xhost` and ``.local`` so that a config module can
check ``train.stream.addr`` and ``train.stream.depth`` when a recipe loads, without importing the
stream stack (numpy, pyarrow).
"""

from __future__ import annotations

from eaglenest.errors import ConfigError

#: Most captures in flight (``train.stream.depth``). Credits are bytes on the socket, granted by the
#: receiver thread: more than a socket buffer holds (~200 KiB by default) blocked that thread on
#: the grant while the publisher, with credits to spend, blocked on its frames: neither moved.
MAX_DEPTH = 4096


def parse_addr(addr: str, key: str = "train.stream.addr") -> tuple[str, int]:
    """``(host, port)`` of ``addr`` (an IPv6 host may be bracketed, ``[::1]:29650``); a
    :class:`ConfigError` naming ``key`` (where the address came from) otherwise."""
    host, _, port = str(addr).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # what a socket or the TCPStore takes
    # isdigit() alone also accepts '²' or '٣', which int() refuses or reads as another number.
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: host:port of the stream's store, got {addr!r}")
    return host, int(port)
