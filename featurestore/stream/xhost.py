"""The streaming bypass across hosts: M capture engines feed N trainer ranks over torch.distributed.

Transport: point-to-point ``send``/``recv`` on a **gloo** process group of its own (trainer ranks
``0..N-1``, engines ``N..N+M-1``), rendezvous through a ``TCPStore`` at ``train.stream.addr`` that
trainer rank 0 hosts. The default process group (FSDP's, vLLM's) is never touched: the group is a
``ProcessGroupGloo`` built on a ``PrefixStore`` of that store (:class:`.group.Group`). Each engine host keeps the local
path unchanged (connector -> Unix socket -> :class:`CaptureStream` with its producer child) and
forwards every capture to the rank it belongs to (:func:`serve`, the ``featurestore stream-serve``
verb). Why gloo and not Mooncake/NIXL, and the measured throughput: docs/featurestore.md.

Partitioning: engine ``e`` and rank ``r`` are linked when ``e % g == r % g`` with ``g = min(M, N)``
(M <= N: an engine serves several ranks; M >= N: a rank is served by several engines, position
``p`` of its share by its ``p % k``-th engine). Each rank computes its own share of the global plan
(``rank_rows``: the rows the table path gives it) and puts the token ids for each of its engines in
the store; an engine merges its ranks' shares by training step, so it never races ahead of the
step the ranks are on. Every sequence is captured once per epoch.

Frames: an int64 header ``[magic, position, T, layers, H, dtype, seq, sent_at_us]``, the token ids
(int64), the hidden states as raw bytes (uint8): no pickles. Credits flow back rank -> engine as
int64 messages (``n`` more, or ``-1``: this rank is done), ``depth // k`` per link, so at most
``train.stream.depth`` captures per rank are sent and not yet consumed.

Failures, measured with gloo (torch 2.13): a peer that dies fails a pending ``recv`` at once with
"Connection closed by peer"; a ``recv`` that times out closes the pair for good, so timeouts are
not polled in short slices but set once to ``train.stream.timeout_s`` (a hung peer). Whoever fails
first writes ``abort`` into the store with a message naming the dead engine or rank; every
participant polls it while it waits (and a store that went away means trainer rank 0 is gone), so
one dead engine or rank fails the whole job, each side with one clear :class:`StoreError`.

Trade-off: the store carries the schedule once (4 bytes per token), and an engine serving several
ranks hands captures out in one order (head-of-line blocking; harmless, ranks step in lockstep).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

import numpy as np

from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.stream import hostcheck
from eaglenest.featurestore.stream.group import Group, lost
from eaglenest.featurestore.stream.local import MAX_DEPTH, CaptureStream, check_socket_path
from eaglenest.paths import pid_alive

log = logging.getLogger(__name__)

MAGIC = 0x454E5331  # "ENS1"
#: The schedule's and frames' layout: a trainer and a stream-serve must agree on it (their eaglenest
#: versions may differ as long as this does not). Raise it with any change to the spec or the frames.
PROTOCOL = 1
TAG_FRAME, TAG_CREDIT = 1, 2
DONE = -1
_DTYPES = ("float32", "bfloat16", "float16")


def engines_of(rank: int, num_engines: int, world_size: int) -> list[int]:
    g = min(num_engines, world_size)
    return [e for e in range(num_engines) if e % g == rank % g]


def ranks_of(engine: int, num_engines: int, world_size: int) -> list[int]:
    g = min(num_engines, world_size)
    return [r for r in range(world_size) if r % g == engine % g]


def _pack(positions, steps, seqs) -> bytes:
    """A share as int32: ``[n, positions, steps, lengths, ids...]`` (token ids < 2**31)."""
    lengths = [len(s) for s in seqs]
    flat = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs]) if seqs else np.zeros(0, np.int64)
    return np.concatenate([[len(seqs)], positions, steps, lengths, flat]).astype(np.int32).tobytes()


def _unpack(raw: bytes):
    a = np.frombuffer(raw, dtype=np.int32).astype(np.int64)
    n = int(a[0])
    pos, steps, lengths = a[1:1 + n], a[1 + n:1 + 2 * n], a[1 + 2 * n:1 + 3 * n]
    ends = np.cumsum(lengths) + 1 + 3 * n
    seqs = [a[e - k:e].tolist() for e, k in zip(ends, lengths)]
    return pos.tolist(), steps.tolist(), seqs


def _frame_problem(tokens: int, layers: int, hidden: int, code: int, want_tokens: int,
                   want_shape: tuple[int, int] | None, want_dtype: str | None = None) -> str | None:
    """What is wrong with a frame header's sizes (None: a capture of the sequence sent, of the
    trainer's ``[layers, hidden]`` and dtype when known). An unknown dtype code or a negative size used
    to surface as 'lost engine' with an IndexError or a torch error; another dtype was trained on."""
    if not 0 <= code < len(_DTYPES):
        return f"dtype code {code} is not one of 0..{len(_DTYPES) - 1}"
    if want_dtype and _DTYPES[code] != want_dtype:
        return f"hidden states of {_DTYPES[code]} where the trainer's features are {want_dtype}"
    if tokens != want_tokens:
        return f"{tokens} tokens for a sequence of {want_tokens}"
    if want_shape is not None and (layers, hidden) != want_shape:
        return (f"hidden states [{tokens}, {layers}, {hidden}] where the trainer's target has [{tokens}, "
                f"{want_shape[0]}, {want_shape[1]}] (layers, hidden size): is stream-serve --target another "
                "model than run.target?")
    if layers < 1 or hidden < 1:
        return f"hidden states [{tokens}, {layers}, {hidden}]"
    return None


def _credit(n: int):
    import torch

    return torch.tensor([n], dtype=torch.int64)


class RankStream:
    """Trainer rank side: its share of captures from its engines, handed out in its read order.

    ``sequences``/``steps``: this rank's samples in read order and the training step of each. Rank
    0 hosts the store and publishes ``spec`` (what the engines capture and how). ``next()`` returns
    ``(token_ids int64 [T], hidden torch [T, layers, H])`` like :class:`CaptureStream`.
    """

    def __init__(self, addr: str, *, rank: int, world_size: int, num_engines: int, spec: dict,
                 sequences: list[list[int]], steps: list[int], depth: int, timeout_s: float,
                 poll_s: float = 0.5):
        if depth < 1:
            raise StoreError(f"stream depth must be >= 1, got {depth} (train.stream.depth)")
        self.engines = engines_of(rank, num_engines, world_size)
        k = len(self.engines)
        if depth > MAX_DEPTH:  # what each engine host's local stream refuses, refused before the group forms
            raise ConfigError(f"train.stream.depth: {depth} captures in flight is more than the {MAX_DEPTH} the "
                              "stream can grant: lower it")
        if depth < k:  # each engine link needs a credit to send at all: k in flight would break the bound
            raise ConfigError(f"train.stream.depth: {depth} is less than the {k} engines that feed rank {rank} "
                              f"(train.stream.engines={num_engines}, {world_size} ranks), each of which holds a "
                              f"capture in flight: set it to {k} or more")
        self.rank, self.world_size, self.num_engines = rank, world_size, num_engines
        self.num_items, self._poll_s = len(sequences), poll_s
        self._lengths = [len(s) for s in sequences]
        #: [layers, hidden] of every capture, when the spec says (the trainer's target).
        self._shape = (len(spec["layer_ids"]) + 1, int(spec["hidden_size"])) \
            if "layer_ids" in spec and "hidden_size" in spec else None
        self._dtype = spec.get("dtype")  # the trainer's features' dtype (an engine's frames must be of it)
        self.group = Group(addr, is_master=rank == 0, timeout_s=timeout_s, who=f"rank {rank}")
        self._claim_rank(addr, rank)
        if rank == 0:
            self.group.store.set("spec", json.dumps({**spec, "protocol": PROTOCOL, "world_size": world_size,
                                                     "num_engines": num_engines, "depth": depth}))
        for j, e in enumerate(self.engines):  # position p goes to engine p % k
            pos = list(range(j, self.num_items, k))
            self.group.store.set(f"share/{rank}/{e}", _pack(pos, [steps[p] for p in pos], [sequences[p] for p in pos]))
        self._pending: dict[int, tuple] = {}
        self._cv = threading.Condition()
        self._error: StoreError | None = None
        self._closed = False
        self.handed = 0
        self.sent_at: dict[int, float] = {}
        self.handed_at: list[float] = []
        self.group.join(rank, world_size + num_engines)
        self._per_link = depth // k
        for e in self.engines:
            self.group.send(_credit(self._per_link), world_size + e, TAG_CREDIT)
        self._thread = threading.Thread(target=self._receive, name="eaglenest-xstream-recv", daemon=True)
        self._thread.start()

    def _claim_rank(self, addr: str, rank: int) -> None:
        """Take ``rank`` in the store, or refuse at once: a second trainer process given the same rank
        (two jobs on one train.stream.addr, a RANK set by hand) overwrote the first one's share, and
        every participant then waited train.stream.timeout_s for a group that never formed."""
        me = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"
        holder = self.group.claim(f"rank-{rank}", me)
        if holder != me:
            raise ConfigError(f"capture stream: trainer rank {rank} at {addr} is already taken by the process on "
                              f"{holder}: one trainer per train.stream.addr, each rank once")

    def _engine(self, pos: int) -> int:
        return self.engines[pos % len(self.engines)]

    def _receive(self) -> None:
        import torch

        pos = 0
        try:
            for pos in range(self.num_items):
                src = self.world_size + self._engine(pos)
                header = torch.empty(8, dtype=torch.int64)
                self.group.recv(header, src, TAG_FRAME)
                magic, p, T, L, H, code, seq, sent_us = header.tolist()
                if magic != MAGIC or p != pos:
                    raise StoreError(f"capture stream: bad frame from engine {self._engine(pos)} "
                                     f"(position {p}, expected {pos})")
                problem = _frame_problem(T, L, H, code, self._lengths[pos], self._shape, self._dtype)
                if problem:  # before anything is allocated: the sizes are the sender's word
                    raise StoreError(f"capture stream: bad frame from engine {self._engine(pos)} at position "
                                     f"{pos}: {problem}")
                ids = torch.empty(T, dtype=torch.int64)
                self.group.recv(ids, src, TAG_FRAME)
                dtype = getattr(torch, _DTYPES[code])
                payload = torch.empty(T * L * H * dtype.itemsize, dtype=torch.uint8)
                self.group.recv(payload, src, TAG_FRAME)
                with self._cv:
                    self.sent_at[len(self.sent_at)] = sent_us / 1e6
                    self._pending[p] = (ids.numpy(), payload.view(dtype).reshape(T, L, H))
                    self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer by next()
            if self._closed:
                return
            if not isinstance(exc, StoreError):
                exc = StoreError(f"capture stream: rank {self.rank} {lost(exc, self.group)} engine "
                                 f"{self._engine(pos)} after {pos} of {self.num_items} captures: "
                                 f"{str(exc).splitlines()[0][:200]}")
            with self._cv:  # this rank's consumer first: telling the others takes store round trips
                self._error = exc
                self._cv.notify_all()
            self.group.abort(str(exc))

    def next(self):
        if self.handed >= self.num_items:
            raise StopIteration
        while True:
            with self._cv:  # never held across a store round trip: the receiver must get it at once
                if self.handed in self._pending:
                    ids, hidden = self._pending.pop(self.handed)
                    break
                if self._error is not None:
                    raise self._error
                if self._closed:
                    raise StoreError("capture stream is closed")
                self._cv.wait(timeout=self._poll_s)
                failed = self._error is not None
            if not failed:
                self.group.check(self._poll_s)
        self.group.check(self._poll_s)  # a failure elsewhere ends this rank too, even while captures flow
        e = self._engine(self.handed)
        self.handed += 1
        self.handed_at.append(time.time())
        if self.handed < self.num_items:
            try:
                self.group.send(_credit(1), self.world_size + e, TAG_CREDIT)
            except RuntimeError:  # the engine is gone; the receiver reports it if it matters
                pass
        return ids, hidden

    def max_in_flight(self) -> int:
        handed = sorted(self.handed_at)
        return max((seq + 1 - int(np.searchsorted(handed, t, side="right")) for seq, t in self.sent_at.items()),
                   default=0)

    def close(self) -> None:
        """Tell the engines this rank is done; rank 0 keeps the store up until everyone is."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self.group.pg is not None:
            for e in self.engines:
                try:
                    self.group.send(_credit(DONE), self.world_size + e, TAG_CREDIT)
                except RuntimeError:
                    pass
        self.group.mark_done(f"rank-{self.rank}")
        # The receiver ends when its engines leave (they do once every rank said done): a daemon
        # thread waking inside gloo while the interpreter exits aborts the process (SIGABRT).
        self._thread.join(timeout=30.0)
        if self.rank == 0:
            names = [f"rank-{r}" for r in range(self.world_size)] + [f"engine-{e}" for e in range(self.num_engines)]
            # After an abort the other trainer ranks must read it before the store goes (engines
            # that find the store gone fail anyway, and the dead one would only delay us).
            self.group.wait_done(names, min(self.group.timeout_s, 120.0), self._poll_s,
                                 ack_names=[f"rank-{r}" for r in range(1, self.world_size)])


def _spec(raw: bytes, addr: str) -> dict:
    """The trainer's spec, refused in one line when it comes from an eaglenest that streams otherwise."""
    try:
        spec = json.loads(raw)
    except ValueError:
        spec = None
    got = spec.get("protocol") if isinstance(spec, dict) else None
    if got != PROTOCOL:
        raise ConfigError(f"--addr {addr}: the trainer there streams with protocol {got} and this stream-serve "
                          f"with {PROTOCOL}: run the same eaglenest version on the trainer and the engine hosts")
    return spec


def engine_captures(spec: dict, sequences: list[list[int]], target: str | None = None):
    """The local capture path: a :class:`CaptureStream` (producer child, Unix socket) on this host."""
    try:
        engine = EngineConfig(**spec["engine"])
    except TypeError as exc:  # a key this eaglenest's EngineConfig does not have
        raise ConfigError(f"the trainer's train.stream engine settings do not fit this stream-serve ({exc}): run the "
                          "same eaglenest version on the trainer and the engine hosts") from None
    return CaptureStream(target or spec["target"], layer_ids=spec["layer_ids"], num_layers=spec["num_layers"],
                         engine=engine, sequences=sequences, depth=int(spec["depth"]),
                         window=int(spec["window"]), trust_remote_code=bool(spec.get("trust_remote_code", False)))


def _take_over(group: Group, engine_rank: int, holder: str, me: str, num_engines: int) -> None:
    """``--engine-rank`` held by ``holder``: taken over when that stream-serve died on this host before it
    joined the group (a restart), else one line. Two hosts given one rank: the group would wait
    train.stream.timeout_s and never form. Restarted after the dead one joined (the others may hold its
    gloo address): the stream is aborted, so every participant fails at once, not after the timeout."""
    host, _, rest = holder.partition(" pid ")
    pid = rest.split(" ", 1)[0]
    if host != socket.gethostname() or not pid.isdigit() or pid_alive(int(pid)):
        raise ConfigError(f"--engine-rank {engine_rank}: already taken by the stream-serve on {holder}; give "
                          f"each engine host its own rank 0..{num_engines - 1}")
    why = group.aborted()
    if why is not None:
        raise StoreError(f"capture stream aborted (engine {engine_rank}): {why}")
    if group.store.check([f"joined/engine-{engine_rank}"]):
        msg = (f"engine {engine_rank}: its stream-serve on {holder} died after it joined the stream's group, "
               "which cannot take another in its place: restart the trainer, then the stream-serves")
        group.abort(msg)
        raise StoreError(f"capture stream: {msg}")
    now = group.store.compare_set(f"claim/engine-{engine_rank}", holder, me).decode()
    if now != me:  # another restart was first
        raise ConfigError(f"--engine-rank {engine_rank}: already taken by the stream-serve on {now}")
    log.warning("engine %d: taking the rank over from the stream-serve on %s, which died before it joined",
                engine_rank, holder)


def serve(addr: str, engine_rank: int, *, target: str | None = None, timeout_s: float = 1800.0,
          poll_s: float = 0.5, captures=None) -> int:
    """One engine host: capture the linked ranks' shares with a local engine, forward each capture.

    ``captures(spec, sequences)``: a context manager iterating ``(ids, hidden)`` in order; default
    :func:`engine_captures` (tests and the transport bench give frames made without an engine)."""
    import torch

    if engine_rank < 0:  # refused before connecting (the trainer's engine count is known only then)
        raise ConfigError(f"--engine-rank {engine_rank}: must be >= 0 (0..train.stream.engines-1)")
    if target is not None:  # found out here, not once the whole group formed and this engine starts
        hostcheck.check_target_flag(target)
    if captures is None:  # the local stream's socket, likewise
        check_socket_path()
    who = f"engine {engine_rank}"
    group = Group(addr, is_master=False, timeout_s=timeout_s, who=who, key="--addr")
    spec = _spec(group.get("spec"), addr)
    N, M = int(spec["world_size"]), int(spec["num_engines"])
    if not 0 <= engine_rank < M:
        raise ConfigError(f"--engine-rank {engine_rank}: the trainer expects train.stream.engines={M} (0..{M - 1})")
    if target is None and captures is None:  # the trainer's path, which this host may not have
        hostcheck.check_trainers_target(str(spec.get("target")))
    if target is not None or captures is None:  # another model than the trainer's: states of another shape
        hostcheck.check_same_shape(target or str(spec.get("target")), spec, given=target is not None)
    me = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"
    holder = group.claim(f"engine-{engine_rank}", me)
    if holder != me:
        _take_over(group, engine_rank, holder, me, M)
    ranks = ranks_of(engine_rank, M, N)
    items = []  # (step, rank, position, sequence): merged by training step
    for r in ranks:
        pos, steps, seqs = _unpack(group.get(f"share/{r}/{engine_rank}"))
        items += [(s, r, p, q) for p, s, q in zip(pos, steps, seqs)]
    items.sort(key=lambda it: it[:3])
    group.put(f"joined/engine-{engine_rank}", me)  # from here on the others may hold its gloo address
    group.join(N + engine_rank, N + M, poll_s)
    credits = {r: 0 for r in ranks}
    closed: dict[int, bool] = {}
    errors: dict[int, str] = {}
    cv = threading.Condition()

    def take_credits(r: int) -> None:
        box = torch.empty(1, dtype=torch.int64)
        while True:
            try:
                group.recv(box, r, TAG_CREDIT)
            except RuntimeError as exc:
                with cv:
                    errors[r] = f"{lost(exc, group)} trainer rank {r}: {str(exc).splitlines()[0][:200]}"
                    cv.notify_all()
                return
            with cv:
                if int(box) == DONE:
                    closed[r] = True
                else:
                    credits[r] += int(box)
                cv.notify_all()
            if int(box) == DONE:
                return

    def wait_credit(r: int) -> bool:
        """True with a credit taken; False when rank r closed its stream. Raises when r or anyone failed."""
        while True:
            with cv:  # not held across a store round trip: the credit threads need it
                if credits[r] > 0:
                    credits[r] -= 1
                    return True
                if r in errors:
                    raise StoreError(f"capture stream: {who} {errors[r]}")
                if closed.get(r):
                    return False
                cv.wait(timeout=poll_s)
            group.check(poll_s)

    threads = [threading.Thread(target=take_credits, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    sent = 0
    try:
        seqs = [it[3] for it in items]
        with (captures(spec, seqs) if captures else engine_captures(spec, seqs, target)) as stream:
            log.info("%s: capturing %d sequences for ranks %s", who, len(items), ranks)
            for (step, r, p, _), (ids, hidden) in zip(items, stream):
                if all(closed.get(x) for x in ranks):
                    break
                group.check(poll_s)
                if closed.get(r) or not wait_credit(r):
                    continue
                code = _DTYPES.index(str(hidden.dtype).removeprefix("torch."))
                T, L, H = hidden.shape
                header = torch.tensor([MAGIC, p, T, L, H, code, sent, int(time.time() * 1e6)], dtype=torch.int64)
                try:
                    group.send(header, r, TAG_FRAME)
                    group.send(torch.from_numpy(ids), r, TAG_FRAME)
                    group.send(hidden.contiguous().reshape(-1).view(torch.uint8), r, TAG_FRAME)
                except RuntimeError as exc:
                    raise StoreError(f"capture stream: {who} lost trainer rank {r} after {sent} captures: "
                                     f"{str(exc).splitlines()[0][:200]}") from None
                sent += 1
        # Every linked rank says it is done (or fails) before this engine leaves.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with cv:
                if all(closed.get(r) or r in errors for r in ranks):
                    break
                cv.wait(timeout=poll_s)
            group.check(poll_s)
        log.info("%s: %d captures sent", who, sent)
        group.mark_done(f"engine-{engine_rank}")
        return 0
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (eaglenest.launch): the ranks are told, the CLI ends by it
        group.abort(f"{who}: stream-serve was stopped (interrupted or terminated) after {sent} "
                    f"capture{'s' * (sent != 1)}")
        raise
    except BaseException as exc:
        msg = str(exc) if isinstance(exc, StoreError) else f"{who}: {type(exc).__name__}: {exc}"
        if not msg.startswith("capture stream aborted"):
            group.abort(msg)
        if isinstance(exc, StoreError):
            raise
        raise StoreError(f"capture stream: {msg}") from exc
    finally:
        # Each credit thread ends with a DONE or its rank's exit (an aborted rank closes, sending
        # DONE); a daemon thread waking inside gloo while the interpreter exits aborts the process.
        deadline = time.monotonic() + 30.0
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
