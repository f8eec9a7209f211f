"""The streaming bypass: hidden states from a live vLLM engine to the trainer, no disk in between.

For a target whose features are too large to dump (a 420B MoE writes ~60 KiB per token), the
trainer can consume captures as the engine makes them. Three parts:

* :class:`~eaglenest.featurestore.capture.publish.Publisher` runs inside the engine (the capture
  connector's publish mode, :mod:`eaglenest.featurestore.capture.connector`): each finished request's
  ``[T, layers, H]`` tensor and token ids go as one frame over a Unix-domain socket that the consumer owns.
* The producer (:mod:`eaglenest.featurestore.stream.producer`) is a child process that runs the
  capture engine over the sequences it is given, in windows of at most ``depth`` requests.
* :class:`CaptureStream` (the consumer, in the trainer) listens, starts the producer and hands
  captures out **in the order asked for**, whatever order the engine finishes them in.

Flow control is by credits: the consumer grants ``depth`` at the start and one more each time it
hands a capture out; the publisher sends only against a credit and otherwise blocks the engine's
step. So at most ``depth`` captures are ever sent and not yet consumed, and a slow trainer slows the
engine instead of growing memory. Windows of at most ``depth`` requests keep the reorder buffer
inside the same bound (the capture the consumer waits for can always get a credit).

Failure handling: the consumer polls the producer while it waits and raises :class:`StoreError`
when it died (no hang); the producer treats EOF on its stdin (the control pipe, held only by the
consumer) as "consumer gone" and shuts the engine down. The producer leads its own process
group, so the consumer reaps the engine's processes too when the producer was killed.

Trade-off: every epoch runs the target again (nothing is stored), and only one consumer rank is
fed. Frames are raw bytes plus a small JSON header (no pickles).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from eaglenest.engine import quiet_vllm
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.capture.publish import CREDIT, FRAME, MAGIC
from eaglenest.featurestore.schema import _DTYPES
from eaglenest.featurestore.stream.addr import MAX_DEPTH
from eaglenest.paths import orphans, pid_prefix


log = logging.getLogger(__name__)

#: Longest Unix-domain socket path Linux takes (``sun_path`` is 108 bytes with its NUL).
_MAX_SOCKET_PATH = 107
#: A stream's temp folder (its socket, the producer's log), named with the consumer's pid. One that a
#: SIGKILLed consumer left (pid gone, untouched for STALE_S, its socket still there: a folder kept for
#: the log an error named has none) is removed when the next stream on the machine starts.
DIR_PREFIX = "eaglenest-stream-"
SOCKET_NAME = "captures.sock"
STALE_S = 600.0
#: Longest JSON header of a frame the consumer reads (a publisher's is under 200 bytes).
MAX_HEADER_BYTES = 1 << 16
#: How long the consumer waits, once the engine closed the connection mid-stream, for the producer to exit
#: and say why: an EngineCore that died is seen within 0.5 s, its other processes are ended (up to 10 s),
#: and the producer exits with ``producer.ENGINE_DIED``, its log naming the cause.
EOF_GRACE_S = 20.0


class Channel:
    """Consumer end of the socket: accepts one publisher, grants credits, hands captures out in order.

    A receiver thread drains the socket as frames arrive (a frame is larger than the kernel's socket
    buffer, so without it the engine would wait for every read), keeping at most ``depth``
    captures, which the credits guarantee. ``check()`` is called whenever the receiver waited
    ``poll_s`` for nothing; it raises to end the stream (the producer died). ``next()`` returns
    ``(token_ids int64 [T], hidden torch [T, layers, H])``.
    """

    def __init__(self, path: str, *, num_items: int, depth: int, check, poll_s: float = 0.5,
                 eof_grace_s: float = 0.0):
        if depth < 1:
            raise StoreError(f"stream depth must be >= 1, got {depth} (train.stream.depth)")
        if depth > MAX_DEPTH:
            raise ConfigError(f"train.stream.depth: {depth} captures in flight is more than the {MAX_DEPTH} the "
                              "stream can grant (each one a whole conversation's hidden states): lower it")
        self.path, self.num_items, self.depth = path, num_items, depth
        self._check, self._poll_s, self._eof_grace_s = check, poll_s, eof_grace_s
        self._listener: socket.socket | None = _listen(path)
        self._conn: socket.socket | None = None
        self._pending: dict[int, tuple[dict, bytearray]] = {}
        #: Tags received so far: a tag sent twice is refused even once its first capture was handed out.
        self._tags: set[int] = set()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.handed = 0
        #: Send time of every frame by its publisher sequence number, and each hand-out time.
        self.sent_at: dict[int, float] = {}
        self.handed_at: list[float] = []
        self._thread = threading.Thread(target=self._receive, name="eaglenest-stream-recv", daemon=True)
        self._thread.start()

    def next(self):
        import torch

        if self.handed >= self.num_items:
            raise StopIteration
        with self._cv:
            while self.handed not in self._pending:
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise StoreError("capture stream is closed")
                self._cv.wait(timeout=self._poll_s)
            header, payload = self._pending.pop(self.handed)
        shape, dtype = tuple(header["shape"]), header["dtype"]
        ids = np.frombuffer(payload, dtype=np.int64, count=shape[0]).copy()
        # A view of the received buffer (writable, one allocation per capture): no copy.
        hidden = torch.from_numpy(np.frombuffer(payload, dtype=_DTYPES[dtype], offset=shape[0] * 8).reshape(shape))
        if dtype == "bfloat16":
            hidden = hidden.view(torch.bfloat16)
        self.handed += 1
        self.handed_at.append(time.time())
        if self.handed < self.num_items:
            try:
                self._conn.sendall(CREDIT)  # one more capture may be sent
            except OSError:  # the engine is gone; the receiver reports why
                pass
        return ids, hidden

    def max_in_flight(self) -> int:
        """Most captures ever sent and not yet handed out, from the send and hand-out times."""
        handed = sorted(self.handed_at)
        worst = 0
        for seq, t in self.sent_at.items():
            worst = max(worst, seq + 1 - int(np.searchsorted(handed, t, side="right")))
        return worst

    # -- the receiver thread --------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            self._wait_readable(self._listener)
            self._conn, _ = self._listener.accept()
            self._conn.sendall(CREDIT * self.depth)
            for _ in range(self.num_items):
                header, payload = self._recv_frame()
                tag = header.get("tag")
                with self._cv:
                    # A tag twice would take another's place in the count of frames: that one would never
                    # be read, and the consumer would wait for it for ever.
                    if not isinstance(tag, int) or not 0 <= tag < self.num_items or tag in self._tags:
                        raise StoreError(f"capture stream: unexpected tag {tag!r} (another client on the socket?)")
                    self._tags.add(tag)
                    self.sent_at[int(header["seq"])] = float(header["sent_at"])
                    self._pending[tag] = (header, payload)
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer by next()
            if self._closed:
                return
            if not isinstance(exc, StoreError):
                exc = StoreError(f"capture stream: {type(exc).__name__}: {exc}")
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _wait_readable(self, sock: socket.socket) -> None:
        while not select.select([sock], [], [], self._poll_s)[0]:
            if self._closed:
                raise StoreError("capture stream is closed")
            self._check()

    def _recv_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._wait_readable(self._conn)
            try:
                k = self._conn.recv_into(view[got:])
            except ConnectionResetError:  # the engine process died mid-send (EngineCore killed): as EOF
                k = 0
            if k == 0:
                self._check_after_eof()
                raise StoreError(f"capture stream: the engine closed the connection after {len(self.sent_at)} "
                                 f"of {self.num_items} captures")
            got += k
        return buf

    def _check_after_eof(self) -> None:
        """``check()`` until it raises or ``eof_grace_s`` passed: the engine's end of the socket closed before
        the producer noticed, and the producer's exit says why (its log, which an error naming it keeps)."""
        deadline = time.monotonic() + self._eof_grace_s
        while True:
            self._check()
            if self._closed or time.monotonic() >= deadline:
                return
            time.sleep(min(self._poll_s, 0.1))

    def _recv_frame(self) -> tuple[dict, bytearray]:
        magic, hlen, plen = FRAME.unpack(self._recv_exactly(FRAME.size))
        if magic != MAGIC:
            raise StoreError("capture stream: bad frame (not an eaglenest publisher)")
        if hlen > MAX_HEADER_BYTES:  # the sender's word: waiting for that many bytes hung the stream
            raise StoreError(f"capture stream: bad frame (a header of {hlen} bytes, more than {MAX_HEADER_BYTES}; "
                             "a publisher of another eaglenest version?)")
        try:
            header = json.loads(bytes(self._recv_exactly(hlen)))
        except ValueError:  # not UTF-8, not JSON
            header = None
        problem = _frame_problem(header, plen)
        if problem:  # before the payload is allocated: its size is the sender's word
            raise StoreError(f"capture stream: bad frame ({problem}; a publisher of another eaglenest version?)")
        return header, self._recv_exactly(plen)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=2 * self._poll_s + 1)
        for sock in (self._conn, self._listener):
            if sock is not None:
                sock.close()
        self._conn = self._listener = None


class CaptureStream:
    """Consumer side: a producer child process capturing ``sequences``; captures come out in order.

    ``next()`` (or iterating) gives ``(token_ids int64 [T], hidden torch [T, layers, H])`` of the next
    sequence, ``len(layer_ids) + 1`` layers: the aux layers then the last layer (as
    :class:`Capturer`). Use as a context manager; ``close()`` stops the producer and its engine
    whatever state they are in. ``env`` adds to the producer's environment (e.g.
    ``CUDA_VISIBLE_DEVICES`` of the engine).
    """

    def __init__(self, target: str, *, layer_ids, num_layers: int, engine, sequences: list[list[int]],
                 depth: int = 8, window: int = 0, poll_s: float = 0.5, log_path: str | None = None,
                 env: dict[str, str] | None = None, trust_remote_code: bool = False):
        self.proc = None
        self._keep_log = False  # set once an error names the producer's log: close() leaves it
        _remove_orphans()
        self._dir = Path(tempfile.mkdtemp(prefix=pid_prefix(DIR_PREFIX)))  # mode 0700: only we connect
        self.log_path = log_path or str(self._dir / "producer.log")
        try:
            self.channel = Channel(str(self._dir / SOCKET_NAME), num_items=len(sequences), depth=depth,
                                   check=self._check_producer, poll_s=poll_s, eof_grace_s=EOF_GRACE_S)
        except BaseException:  # refused before anything started: leave no temp folder behind
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        spec = {"target": str(target), "layer_ids": [int(i) for i in layer_ids], "num_layers": int(num_layers),
                "engine": dataclasses.asdict(engine), "socket": self.channel.path, "storage_dir": str(self._dir),
                "window": max(1, min(window or depth, depth)), "trust_remote_code": bool(trust_remote_code),
                "sequences": [[int(t) for t in s] for s in sequences]}
        if not sequences:  # nothing to capture (an engine host whose ranks' shares are empty): no engine
            return
        quiet_vllm()  # the producer starts an engine: it inherits the run's vLLM logging (common/engine.py)
        try:
            self._start_producer(spec, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        except BaseException:  # nothing to hand out: stop what did start, leave no temp folder
            self.close(grace_s=5.0)
            raise

    def _start_producer(self, spec: dict, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eaglenest.featurestore.stream.producer"], stdin=subprocess.PIPE,
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.pid = self.proc.pid
        try:
            self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
            self.proc.stdin.flush()  # stdin stays open: it is the control channel (EOF = consumer gone)
        except BrokenPipeError:  # it died before reading the spec; its log goes with the temp folder
            code = self.proc.wait(timeout=30)
            raise StoreError(f"capture stream: the producer (pid {self.pid}) exited with code {code} before "
                             f"reading its spec: {_last_line(self.log_path)}") from None

    def __enter__(self) -> "CaptureStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        while self.channel.handed < self.channel.num_items:
            yield self.next()

    def next(self):
        if self.proc is None and self.channel.num_items:
            raise StoreError("capture stream is closed")
        return self.channel.next()  # StopIteration once every capture was handed out (at once for none)

    def max_in_flight(self) -> int:
        return self.channel.max_in_flight()

    def _check_producer(self) -> None:
        proc = self.proc
        code = proc.poll() if proc is not None else None
        if code is None:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._keep_log = True
        # Its last error line, not only the log's path: on a cluster that file is on another machine's disk.
        raise StoreError(f"capture stream: the producer (pid {proc.pid}) {how} after {self.channel.handed} "
                         f"of {self.channel.num_items} captures: {_last_line(self.log_path)}; its log: {self.log_path}")

    def close(self, grace_s: float = 30.0) -> None:
        """Stop the producer (EOF on its control pipe), then reap its process group; idempotent."""
        self.channel.close()
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("capture producer %d did not stop in %.0f s: terminating it", proc.pid, grace_s)
            _reap_group(proc)
        if self._keep_log:  # the error the caller got points at the log: only the socket goes
            Path(self.channel.path).unlink(missing_ok=True)
        else:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __del__(self):  # pragma: no cover - last resort; close() is the API
        if getattr(self, "proc", None) is not None:
            self.close(grace_s=5.0)


def _remove_orphans() -> None:
    """The temp folders of streams whose consumer was killed (see :data:`DIR_PREFIX`)."""
    for stale in orphans(tempfile.gettempdir(), DIR_PREFIX, min_age_s=STALE_S):
        if (stale / SOCKET_NAME).exists():
            shutil.rmtree(stale, ignore_errors=True)


def _frame_problem(header, payload_bytes: int) -> str | None:
    """What is wrong with a frame's header, given its payload size (None: a well-formed capture:
    int64 ids of ``shape[0]`` tokens, then ``[T, layers, H]`` hidden states of ``dtype``)."""
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    if header.get("dtype") not in _DTYPES:
        return f"dtype {header.get('dtype')!r} is not one of {', '.join(_DTYPES)}"
    shape = header.get("shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(type(n) is int and n >= 0 for n in shape)):
        return f"shape {shape!r} is not [tokens, layers, hidden]"
    if not all(type(header.get(k)) in (int, float) for k in ("seq", "sent_at")):
        return "no seq or sent_at"
    want = shape[0] * 8 + shape[0] * shape[1] * shape[2] * _DTYPES[header["dtype"]].itemsize
    return None if want == payload_bytes else f"{payload_bytes} payload bytes for shape {shape}, expected {want}"


def _last_line(path: str) -> str:
    """The last line of a log's tail that names an error, else its last line (300 characters at most)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line for line in lines if "Error" in line or "error" in line or " ERROR " in line]
    # quoted in a one-line error: without the producer's logging prefix (its time, level and logger name)
    return _LOG_PREFIX.sub("", (errors or lines or ["(its log is empty)"])[-1].strip())[:300]


#: The producer's logging prefix (``producer.main``: "%(asctime)s %(levelname)s %(name)s: ").
_LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ [\w.]+: ")


def check_socket_path() -> None:
    """What :func:`_listen` would refuse of this process's temp dir (its stream's socket path too long), refused
    before anything starts: an engine host found out once it had joined the cross-host stream, which its
    failure then ended for every trainer rank."""
    path = os.path.join(tempfile.gettempdir(), f"{pid_prefix(DIR_PREFIX)}{'x' * 8}", SOCKET_NAME)  # mkdtemp's 8
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise StoreError(f"capture stream: cannot listen at {path} (a path of {len(os.fsencode(path))} bytes); "
                         f"{_SHORTER_TMPDIR}")


#: What a socket path too long for the kernel asks of the user.
_SHORTER_TMPDIR = f"a Unix socket path holds at most {_MAX_SOCKET_PATH} bytes: set TMPDIR to a shorter folder"


def _listen(path: str) -> socket.socket:
    """A Unix-domain socket listening at ``path``; a path the kernel refuses (longer than ~107
    bytes: a deep ``TMPDIR``) is one :class:`StoreError` naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1)
    except OSError as exc:
        sock.close()
        hint = f"; {_SHORTER_TMPDIR}" if len(os.fsencode(path)) > _MAX_SOCKET_PATH else ""
        raise StoreError(f"capture stream: cannot listen at {path} ({exc.strerror or exc}){hint}") from None
    return sock


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in group ``pgid`` (Linux /proc; killpg elsewhere)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _reap_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, whatever is left of the producer's own process group (engine children)."""
    pgid = proc.pid  # start_new_session: the producer leads a group of its own
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not _group_alive(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
    proc.poll()
