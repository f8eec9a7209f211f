"""The cross-host stream's address: ``host:port`` of the TCPStore that trainer rank 0 hosts, the
most captures a stream grants in flight, and the longest wait for a peer it accepts.

Apart from :mod:`eaglenest.featurestore.stream.xhost` and ``.local`` so that a config module can
check ``train.stream.addr``, ``train.stream.depth`` and ``train.stream.timeout_s`` when a recipe
loads, without importing the stream stack (numpy, pyarrow, torch).
"""

from __future__ import annotations

import ipaddress
import re
import socket

from eaglenest.errors import ConfigError

#: Most captures in flight (``train.stream.depth``). Credits are bytes on the socket, granted by the
#: receiver thread: more than a socket buffer holds (~200 KiB by default) blocked that thread on
#: the grant while the publisher, with credits to spend, blocked on its frames: neither moved.
MAX_DEPTH = 4096

#: Longest wait for a peer a stream accepts (a year; ``train.stream.timeout_s``, stream-serve
#: ``--timeout-s``): a timedelta, and the store's, hold it.
MAX_TIMEOUT_S = 365 * 24 * 3600.0

#: One label of a host name (RFC 1123, plus '_' as container and cluster names use): 1-63 ASCII
#: letters, digits, '-' or '_', not starting or ending with '-'.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def parse_addr(addr: str, key: str = "train.stream.addr") -> tuple[str, int]:
    """``(host, port)`` of ``addr`` (an IPv6 host in brackets, ``[::1]:29650``); a
    :class:`ConfigError` naming ``key`` (where the address came from) otherwise."""
    if "://" in str(addr):  # tcp://HOST:PORT, as a Dask scheduler's address is written
        raise ConfigError(f"{key}: host:port of the stream's store, not a URL: got {addr!r}")
    host, _, port = str(addr).rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]  # what a socket or the TCPStore takes
    # isdigit() alone also accepts '²' or '٣', which int() refuses or reads as another number.
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: host:port of the stream's store, got {addr!r}")
    problem = _host_problem(host, bracketed)
    if problem:
        raise ConfigError(f"{key}: {problem}")
    return host, int(port)


def _host_problem(host: str, bracketed: bool) -> str | None:
    """Why ``host`` is no host the resolver and the TCPStore take (None: it is one). A name the
    resolver cannot encode (an empty or 64-character label) raised a UnicodeError traceback, and one
    holding a space or a newline was retried for the whole timeout."""
    shown = repr(host[:80])
    if bracketed or ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"host {shown} is not an IPv6 address"
        return None if bracketed else f"the IPv6 host {shown} goes in brackets ([{host}]:PORT)"
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        return (f"host {shown} is neither an IP address nor a host name (ASCII letters, digits, '-' and '_' in "
                "dot-separated parts of 1-63 characters; an international name in its xn-- form)")
    if labels[-1].isdigit():  # no top-level domain is all digits (RFC 3696): an IPv4 address, or a typo of one
        try:
            socket.inet_aton(host)  # what the resolver takes as an address (127.1 too)
        except OSError:  # an engine host retried it as a name not published yet, for its whole timeout
            return f"host {shown} is not an IPv4 address"
    return None
