"""Run ingest shards as Dask tasks: a LocalCluster by default, or a running scheduler by address.

Each task regenerates one shard with a backend cached per worker process (an engine is started once
per worker, not once per shard) and writes its rows as Lance fragments straight into the store; only
the small fragment metadata travels back. The driver commits each shard as its future completes,
so every shard is committed exactly once, by one process. If a worker dies mid-shard, Dask's
scheduler reruns the task on another worker (up to ``distributed.scheduler.allowed-failures``);
whatever the dead worker had written is never committed. The store must be on storage every worker
can reach (a shared filesystem or an object store) and every worker needs the target locally.

What a real cluster (``dask scheduler`` + ``dask worker`` processes) adds over a LocalCluster, and
how it is handled here:

* Workers have their own working directory: local target and store paths are made absolute on the
  driver, and a worker that cannot see them fails the shard with one line naming the key.
* ``dask worker`` runs each worker as a daemonic child of its nanny, and daemonic processes may not
  start children, which a vLLM engine needs: refused with one line naming the setting.
* A worker SIGKILLed (by the nanny's memory limit, the OOM killer, a preemption) would leave its
  vLLM engine processes running on the node: each worker arms :mod:`eaglenest.reaper`, whose
  watchdog ends them when the worker process dies; the nanny restarts the worker.
* A ``dask worker`` is no child of the driver: the store's options (``run.storage_options``, held
  as ``${VAR}`` references) travel with each task; the variables they name must be set on workers.
* A scheduler that is not there fails within ``CONNECT_TIMEOUT_S``, before anything is written.

Trade-offs: one engine per worker process, kept warm for later builds until the worker exits (a
second build on the same workers starts in seconds; the memory stays held: restart the workers to
free it). A backend key change (other engine settings or target, or new files at the target's path)
closes the old engine first, so a worker never holds two. On a 2-core machine a cluster adds
orchestration, not speed; the point is the same code on a real cluster, where each worker holds a
GPU and its own engine.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
import traceback
import uuid
from concurrent.futures import CancelledError

from eaglenest import faults, reaper
from eaglenest.engine import quiet_vllm
from eaglenest.errors import ConfigError, EaglenestError, StoreError, require
from eaglenest.ingest.shard import make_backend, run_shard
from eaglenest.runconfig import register_storage_options, registered_storage_options
from eaglenest.target import pin_revision, pinned_revision

log = logging.getLogger(__name__)

#: Seconds to reach the scheduler; a wrong or dead address fails after this, before any write.
CONNECT_TIMEOUT_S = 10.0

#: The ``ingest.*`` keys a backend is built from: a worker reuses its engine while they are unchanged.
BACKEND_KEYS = ("backend", "engine", "endpoints", "allow_remote_endpoints", "api_key_env", "allow_plaintext_api_key",
                "request_timeout_s", "max_retries", "retry_backoff_s", "in_flight_per_endpoint", "max_in_flight",
                "chat_template_kwargs")

_BACKENDS: dict[str, object] = {}
_LOCK = threading.Lock()  # a worker with --nthreads > 1 still runs one shard on its engine at a time


def _worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:  # not inside a Dask task (a unit test calling the checks directly)
        return f"pid {os.getpid()}"


def check_worker(cfg, target: str, store_uri: str) -> None:
    """Runs on a worker before any work: what a cluster set up differently from the driver gets wrong."""
    where = _worker_name()
    if cfg.backend == "vllm" and multiprocessing.current_process().daemon:
        raise ConfigError(f"ingest.dask_scheduler: Dask worker {where} is a daemonic process and cannot start the "
                          "vLLM engine's processes; start the workers with DASK_DISTRIBUTED__WORKER__DAEMON=False "
                          "in their environment (or dask worker --no-nanny)")
    if os.path.isabs(target) and not os.path.isdir(target):
        raise ConfigError(f"run.target: {target} does not exist on Dask worker {where}; every worker needs the "
                          "target at the same path")
    store_dir = _store_dir(store_uri)
    if store_dir is not None and not os.path.isdir(store_dir):
        raise StoreError(f"run.store: {store_uri} is not visible on Dask worker {where}; put the store on a "
                         "filesystem every worker shares, or on an object store")


def _store_dir(store_uri: str) -> str | None:
    """A local store's directory (``file:///x`` is ``/x``, docs/storage.md); None for an object store."""
    if store_uri[:len("file://")].lower() == "file://":
        return store_uri[len("file://"):]
    return None if "://" in store_uri else store_uri


def _target_stamp(target: str) -> tuple:
    """The target folder's files by name, size and mtime: weights replaced at the same path are another
    target, so a worker's warm engine must not serve them (nothing for a hub id)."""
    try:
        with os.scandir(target) as entries:
            return tuple(sorted((e.name, st.st_size, st.st_mtime_ns) for e in entries if e.is_file()
                                for st in (e.stat(),)))
    except OSError:
        return ()


def _backend(cfg, target: str, trust_remote_code: bool):
    key = repr((tuple(getattr(cfg, k) for k in BACKEND_KEYS), target, pinned_revision(target), _target_stamp(target),
                trust_remote_code))
    if key not in _BACKENDS:
        _close_backends()  # one engine per worker: never two warm at once
        if cfg.backend == "vllm":
            reaper.guard()  # this worker's engine processes end with it, even on SIGKILL
        _BACKENDS[key] = make_backend(cfg, target, trust_remote_code=trust_remote_code)
    return _BACKENDS[key]


def adopt_storage_options(registered: dict[str, dict[str, str]] | None) -> None:
    """Runs on a worker: take the driver's registered store options (``${VAR}`` references, never
    secrets; the variables must be set on the worker). A worker never resolved the recipe, so the
    options come with every task, explicitly (nothing is passed through the environment)."""
    for uri, options in (registered or {}).items():
        register_storage_options(uri, options)


def _shard_task(cfg, target: str, store_uri: str, entries, gen, gen_id: str, think=None,
                trust_remote_code: bool = False, storage_options: dict | None = None, revision: str = "") -> dict:
    """Runs on a worker. Hooks for the fault tests: ``EAGLENEST_TEST_SHARD_STARTED`` names a directory
    where the task drops ``<pid>-<first sample id>`` before working, ``EAGLENEST_TEST_SHARD_WRITTEN``
    one where it drops the same name once the shard's fragments are written (then the fault point
    ``ingest.shard_written`` holds that window), so a test can kill the process in either."""
    name = f"{os.getpid()}-{entries[0].sample_id}"
    with _LOCK:
        _mark("EAGLENEST_TEST_SHARD_STARTED", name)
        adopt_storage_options(storage_options)
        pin_revision(target, revision)  # run.target_revision: the driver's, sent with every task like the options
        check_worker(cfg, target, store_uri)
        backend = _backend(cfg, target, trust_remote_code)
        before = getattr(backend, "retries", 0)
        res = run_shard(backend, store_uri, entries, gen, gen_id, think=think)
        res["retries"] = getattr(backend, "retries", 0) - before
        _mark("EAGLENEST_TEST_SHARD_WRITTEN", name)
        faults.delay("ingest.shard_written")
        return res


def _mark(env: str, name: str) -> None:
    marker_dir = os.environ.get(env)
    if marker_dir:
        open(os.path.join(marker_dir, name), "w").close()


def _check_handshake(host_port) -> None:
    """A Dask scheduler writes its handshake as soon as it accepts: a port that accepts and stays
    silent (a dashboard, another service) would hang ``Client`` for ever (its handshake read has no
    timeout), so wait for the first byte here, within ``CONNECT_TIMEOUT_S``."""
    with socket.create_connection(host_port, timeout=CONNECT_TIMEOUT_S) as sock:
        try:
            first = sock.recv(1)
        except TimeoutError:
            raise TimeoutError(f"the port accepted but sent no Dask handshake in {CONNECT_TIMEOUT_S:g} s: "
                               "is it a scheduler's port (not its dashboard)?") from None
    if not first:
        raise ConnectionError("the port closed the connection without a Dask handshake")


def _loop_start_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is distributed's IO-loop thread not starting within its 10 s (its ``LoopRunner``
    asserts the loop exists; seen on a loaded machine): no bug of the caller's, and no traceback for one."""
    return isinstance(exc, AssertionError) and any(
        frame.name == "_start_unlocked" for frame in traceback.extract_tb(exc.__traceback__))


LOOP_TIMEOUT = ("distributed's IO loop did not start within 10 s (is the machine overloaded?); "
                "re-run when it is less busy")


def connect(address: str):
    """A ``distributed.Client`` of the running scheduler at ``address``, or one line naming the key."""
    distributed = require("distributed")
    try:
        scheme = distributed.comm.parse_address(address)[0].lower()
        if scheme == "inproc":  # distributed failed on it with "not enough values to unpack"
            raise ValueError("inproc:// names a scheduler inside one process, never one a build can join; "
                             "give the scheduler's tcp://host:port")
        if scheme == "tcp":  # refused: at once (Client would retry)
            _check_handshake(distributed.comm.get_address_host_port(address))
        client = distributed.Client(address, timeout=CONNECT_TIMEOUT_S)
    except AssertionError as exc:
        if not _loop_start_timeout(exc):
            raise
        raise ConfigError(f"ingest.dask_scheduler: cannot join the Dask scheduler at {address}: "
                          f"{LOOP_TIMEOUT}") from None
    except (OSError, ValueError, TypeError) as exc:  # TypeError: tls:// without TLS settings, ucx:// without ucx
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"ingest.dask_scheduler: cannot reach a Dask scheduler at {address} ({reason}); "
                          "start one (dask scheduler) or fix the address") from None
    if not client.scheduler_info().get("workers"):
        log.warning("the Dask scheduler at %s has no workers yet: shards wait until one joins", address)
    return client


def client_for(cfg):
    """A connected ``distributed.Client`` (closing it also closes a LocalCluster it started)."""
    distributed = require("distributed")
    import dask

    if cfg.dask_scheduler:
        return connect(cfg.dask_scheduler)
    # Workers must be allowed children: an in-process vLLM engine spawns its engine-core process.
    dask.config.set({"distributed.worker.daemon": False})
    quiet_vllm()  # the workers start engines: they inherit the run's vLLM logging (common/engine.py)
    try:
        cluster = distributed.LocalCluster(n_workers=cfg.dask_workers, threads_per_worker=1, processes=True,
                                           dashboard_address=None, host="127.0.0.1")
    except AssertionError as exc:
        if not _loop_start_timeout(exc):
            raise
        raise EaglenestError(f"ingest.executor: cannot start a Dask LocalCluster: {LOOP_TIMEOUT}") from None
    client = distributed.Client(cluster)
    client._eaglenest_cluster = cluster
    return client


def _close_backends() -> int:
    """Runs on each worker: stop its cached engines (their engine-core processes would outlive it)."""
    n = len(_BACKENDS)
    while _BACKENDS:
        _BACKENDS.popitem()[1].close()
    return n


def close(client) -> None:
    cluster = getattr(client, "_eaglenest_cluster", None)
    if cluster is not None:  # a cluster we started: its workers go now, so must their engines
        try:
            client.run(_close_backends)
        except Exception:  # noqa: BLE001 - best effort; a dead worker has nothing left to close
            log.debug("closing worker engines failed", exc_info=True)
    client.close()
    if cluster is not None:
        cluster.close()


def _local(path: str) -> str:
    """An absolute path for a local path the driver can see (workers have another cwd); else as is."""
    return path if "://" in path or not os.path.exists(path) else os.path.abspath(path)


def killed(exc) -> str:
    """Which task and workers a ``KilledWorker`` names, whole: its text ends in a paragraph of advice
    that a cut to a fixed length kept while dropping the task key or the last worker's address."""
    last = getattr(exc.last_worker, "address", exc.last_worker)
    return (f"task {exc.task!r} died on {exc.allowed_failures + 1} worker(s), the last {last}; "
            "see the workers' logs (an OOM kill, a crash in the engine)")


def run(shards, *, cfg, target, store_uri, gen, gen_id, on_result, client=None, think=None,
        trust_remote_code: bool = False) -> None:
    """Submit every shard; call ``on_result(k, result)`` on the driver as each finishes."""
    from distributed import KilledWorker, as_completed

    if (store_dir := _store_dir(store_uri)) is not None:
        os.makedirs(store_dir, exist_ok=True)  # workers check they see it
    target, store_uri = _local(target), _local(store_uri)
    if think is not None:
        think = dataclasses.replace(think, target=target)  # it decodes with the target on the worker
    own = client is None
    client = client or client_for(cfg)
    try:
        options = registered_storage_options()  # the driver's, by store URI
        # Task keys are global to the scheduler: another build's shard of the same prompts (another store
        # or target) must not be mistaken for this one's, so each run's keys carry their own token.
        run_id = uuid.uuid4().hex[:12]
        futures = {client.submit(_shard_task, cfg, target, store_uri, shard, gen, gen_id, think, trust_remote_code,
                                 options, pinned_revision(target), pure=False,
                                 key=f"ingest-shard-{k}-{shard[0].sample_id}-{run_id}"): k
                   for k, shard in enumerate(shards)}
        for fut in as_completed(futures):
            try:
                res = fut.result()
            except KilledWorker as exc:  # the same shard killed allowed-failures + 1 workers
                raise EaglenestError(f"ingest.executor: shard {futures[fut]} killed every Dask worker that ran it "
                                     f"({killed(exc)}); committed shards are kept and a re-run resumes after "
                                     "them") from None
            except CancelledError as exc:  # the scheduler went away: every pending shard is cancelled
                raise EaglenestError(f"ingest.dask_scheduler: lost the Dask scheduler during shard {futures[fut]} "
                                     f"({' '.join(str(exc).split())[:200]}); committed shards are kept: restart "
                                     "the scheduler and re-run to resume after them") from None
            on_result(futures[fut], res)
    finally:
        if own:
            close(client)
