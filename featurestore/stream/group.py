"""The cross-host stream's rendezvous and transport: the ``TCPStore`` at ``train.stream.addr`` that
trainer rank 0 hosts, the gloo group of its own built on it, and the abort flag every participant polls.

Apart from :mod:`eaglenest.featurestore.stream.xhost` (the schedule, the frames, the trainer rank's and
the engine host's loops) so that what can go wrong with an address, a store or a peer is in one place:
a client that cannot reach the store, a store that cannot be hosted, a group that does not form, a peer
that is lost or silent. Trade-off: every call goes through the store or gloo with one timeout,
``train.stream.timeout_s``, set once (a gloo ``recv`` that times out closes the pair for good).
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import threading
import time

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.stream.addr import MAX_TIMEOUT_S, parse_addr
from eaglenest.launch import QuietCalls, quiet_cpp_log

log = logging.getLogger(__name__)


#: How long trainer rank 0 tries to reach the store it hosts at an address that is not this host's (a port
#: forwarded to it answers at once): the store's own client retried it for the whole timeout (30 min).
FOREIGN_CONNECT_S = 5.0


def is_local(host: str, addr: str, key: str) -> bool:
    """Whether ``host`` resolves to an address of this host; a name that does not resolve is one
    :class:`ConfigError` naming ``key``: trainer rank 0's own store client retried it for the whole timeout."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a label the resolver cannot encode
        raise ConfigError(f"{key}: {addr}: cannot resolve host {host!r} ({getattr(exc, 'strerror', None) or exc}): "
                          f"set {key} to trainer rank 0's host name or address (here: {_here(addr)})") from None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))  # port 0: the store's own port is its to take
            return True
        except OSError:  # EADDRNOTAVAIL: no interface of this host has that address
            continue
    return False


def _here(addr: str) -> str:
    return f"{socket.gethostname()}:{addr.rpartition(':')[2]}"


def _wait_reachable(host: str, port: int, timeout_s: float, what: str) -> None:
    """Wait until something listens at host:port (the trainer's rank 0 may start later), else one
    line: a TCPStore client that never connects logs its C++ frames to stderr before it raises."""
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, max(timeout_s, 0.1))).close()
            return
        except OSError as exc:
            if isinstance(exc, socket.gaierror) and not said:  # a typo, or a name not published yet (a pod)
                log.warning("%s: cannot resolve %s yet (%s); trying again for up to %.0f s", what, host,
                            exc.strerror or exc, timeout_s)
                said = True
            if time.monotonic() >= deadline:
                raise StoreError(f"{what}: nothing listens there after {timeout_s:.0f} s "
                                 f"({exc.strerror or exc}); is the trainer's rank 0 running?") from None
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))


def _tcp_store(host: str, port: int, *, is_master: bool, timeout: datetime.timedelta):
    """A TCPStore hosted (``is_master``) or reached at host:port, within ``timeout``. A client's
    handshake has no timeout of its own (torch 2.13): a listener that accepts and never answers (a
    stopped trainer rank 0, another service on the port) held it for ever. So a client is made in a
    helper thread, given up (a :class:`TimeoutError`) if it has not answered by then; that thread
    stays blocked in C++ until the process ends (a daemon: it keeps no process alive)."""
    import torch.distributed as dist

    if is_master:
        with quiet_cpp_log():  # its own client's retries at an address that does not answer: no C++ stack each
            return dist.TCPStore(host, port, is_master=True, timeout=timeout, wait_for_workers=False)
    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller
            box["error"] = exc

    worker = threading.Thread(target=connect, name="eaglenest-stream-store", daemon=True)
    with quiet_cpp_log():  # a rank's torch logs at its usual level: no C++ stack per retry before our line
        worker.start()
        worker.join(timeout.total_seconds() + 5.0)  # the client's own retries end at the timeout
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        raise TimeoutError(f"it accepts connections but did not answer as a stream store within "
                           f"{timeout.total_seconds():.0f} s (a stopped trainer rank 0, or another service at "
                           "that port?)")
    return box["store"]


class Group:
    """This stream's TCPStore and gloo group (never the default process group), plus the abort flag."""

    def __init__(self, addr: str, *, is_master: bool, timeout_s: float, who: str, key: str = "train.stream.addr"):
        host, port = parse_addr(addr, key)
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_TIMEOUT_S):  # timedelta(nan or inf): a traceback
            raise ConfigError(f"capture stream ({who}): timeout {timeout_s} s: a number of seconds in (0, "
                              f"{MAX_TIMEOUT_S:.0f}] (train.stream.timeout_s; stream-serve --timeout-s)")
        self.addr, self.who, self.timeout_s = addr, who, timeout_s
        self._host, self._port = host, port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        local = is_local(host, addr, key) if is_master else True
        if not is_master:
            _wait_reachable(host, port, timeout_s, f"capture stream ({who}): cannot reach the stream store at {addr}")
        # Rank 0's store listens on every interface and its own client connects to addr: at an address of
        # another host it answers only through a forwarded port (a container's), at once, or never.
        connect = self.timeout if local else datetime.timedelta(seconds=min(timeout_s, FOREIGN_CONNECT_S))
        try:
            self.store = QuietCalls(_tcp_store(host, port, is_master=is_master, timeout=connect))
            if connect != self.timeout:
                self.store.set_timeout(self.timeout)
        except (RuntimeError, OSError) as exc:
            how, why = ("bind" if is_master else "reach"), str(exc)
            if is_master and "EADDRINUSE" in why:  # two jobs on one address, or another service on the port
                why = (f"port {port} is in use on this host (another job's stream store at the same {key}, or "
                       f"another service): set {key} to a free port")
            elif not local:
                raise ConfigError(f"{key}: {addr}: host {host!r} is not an address of this host, where trainer rank 0 "
                                  f"hosts the stream store, and no port forwarded to it answered there within "
                                  f"{connect.total_seconds():.0f} s: set {key} to this host's name or address (here: "
                                  f"{_here(addr)})") from None
            raise StoreError(f"capture stream ({who}): cannot {how} the stream store at {addr}: {why}") from None
        self.pg = None

    def join(self, group_rank: int, size: int, poll_s: float = 0.5) -> None:
        """Form the gloo group, polling the abort flag meanwhile: a participant that cannot join (an engine
        restarted in place of one that died after joining) ends every wait at once; the group's own
        formation waited the whole timeout. The forming thread, when given up, stays blocked in C++ until
        the process ends (a daemon: it keeps no process alive)."""
        import torch.distributed as dist

        box: dict = {}

        def form() -> None:
            try:  # a client of its own: the store's client holds its lock through a wait, which the poll would share
                client = _tcp_store(self._host, self._port, is_master=False, timeout=self.timeout)
                box["pg"] = dist.ProcessGroupGloo(dist.PrefixStore("eaglenest-stream/pg", client),
                                                  group_rank, size, self.timeout)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller
                box["error"] = exc

        worker = threading.Thread(target=form, name="eaglenest-stream-join", daemon=True)
        with quiet_cpp_log():  # no engine came: each side's C++ "waitForInput ... timed out" before our line
            worker.start()
            while worker.is_alive():
                worker.join(poll_s)
                if worker.is_alive():
                    self.check(poll_s)
        if isinstance(box.get("error"), RuntimeError):
            raise StoreError(f"capture stream ({self.who}): the group of {size} did not form within "
                             f"{self.timeout_s:.0f} s (train.stream.timeout_s): {box['error']}") from None
        if "error" in box:
            raise box["error"]
        self.pg = box["pg"]

    def get(self, key: str) -> bytes:
        try:
            return self.store.get(key)
        except RuntimeError as exc:
            raise StoreError(f"capture stream ({self.who}): no {key!r} in the stream store at {self.addr} "
                             f"within {self.timeout_s:.0f} s: {exc}") from None

    def put(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError as exc:
            raise StoreError(f"capture stream ({self.who}): the stream store at {self.addr} is gone: "
                             f"{str(exc).splitlines()[0][:200]}") from None

    def claim(self, name: str, me: str) -> str:
        """Take ``name`` for ``me`` if no one has (first come, first served); returns who holds it."""
        try:
            return self.store.compare_set(f"claim/{name}", "", me).decode()
        except RuntimeError as exc:
            raise StoreError(f"capture stream ({self.who}): the stream store at {self.addr} is gone: "
                             f"{str(exc).splitlines()[0][:200]}") from None

    @property
    def name(self) -> str:
        return self.who.replace(" ", "-")  # "rank 1" -> "rank-1", the key of done/ and seen-abort/

    def abort(self, message: str) -> None:
        """Tell every participant (first message wins); the store may already be gone."""
        try:
            self.store.compare_set("abort", "", message)
            self.store.set(f"seen-abort/{self.name}", "1")
        except RuntimeError:
            pass

    def aborted(self) -> str | None:
        """The abort message if anyone failed (acknowledged in the store, so that rank 0 keeps it up
        until the others have read it); a message too when the store is unreachable (rank 0 gone)."""
        try:
            if self.store.check(["abort"]):
                message = self.store.get("abort").decode()
                self.store.set(f"seen-abort/{self.name}", "1")
                return message
        except RuntimeError:
            return f"the stream store at {self.addr} is gone (trainer rank 0 exited)"
        return None

    def check(self, poll_s: float) -> None:
        """Raise the abort (at most one store round trip per ``poll_s``)."""
        now = time.monotonic()
        if now - getattr(self, "_checked", 0.0) < poll_s:
            return
        self._checked = now
        why = self.aborted()
        if why is not None:
            raise StoreError(f"capture stream aborted ({self.who}): {why}")

    def mark_done(self, name: str) -> None:
        try:
            self.store.set(f"done/{name}", "1")
        except RuntimeError:
            pass

    def wait_done(self, names: list[str], timeout_s: float, poll_s: float, *, ack_names: list[str] = ()) -> None:
        """Rank 0, before its store goes away: wait until every participant in ``names`` is done. After
        an abort, wait instead (at most 5 s, or 4 polls: a dead participant never answers) until each
        of ``ack_names`` is done or has read the abort, so they fail with its message, not with
        "store gone"."""
        ack_s = max(5.0, 4 * poll_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.store.check([f"done/{n}" for n in names]):
                    return
                if self.store.check(["abort"]):
                    deadline = min(deadline, time.monotonic() + ack_s)
                    while time.monotonic() < deadline:
                        if all(self.store.check([f"done/{n}"]) or self.store.check([f"seen-abort/{n}"])
                               for n in ack_names):
                            return
                        time.sleep(min(poll_s, 0.05))
                    return
            except RuntimeError:
                return
            time.sleep(poll_s)
        log.warning("capture stream: not every participant finished within %.0f s", timeout_s)

    def send(self, tensor, dst: int, tag: int) -> None:
        self.pg.send([tensor], dst, tag).wait(self.timeout)

    def recv(self, tensor, src: int, tag: int) -> None:
        self.pg.recv([tensor], src, tag).wait(self.timeout)


def lost(exc: BaseException, group: Group) -> str:
    """'lost' (the peer's connection closed) or how long a live but silent peer was waited for."""
    if "Timed out" in str(exc):
        return f"heard nothing for {group.timeout_s:.0f} s (train.stream.timeout_s) from"
    return "lost"
