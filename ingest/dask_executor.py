"""Run ingest shards as Dask tasks: a LocalCluster by default, or a running scheduler by address.

Each task regenerates one shard with a backend cached per worker process (an engine is started once
per worker, not once per shard) and writes its rows as Lance fragments straight into the store; only
the small fragment metadata travels back. The driver commits each shard as its future completes,
so every shard is committed exactly once, by one process. If a worker dies mid-shard, Dask's
scheduler reruns the task on another worker (up to ``distributed.scheduler.allowed-failures``);
whatever the dead worker had written is never committed. The store must be on storage every worker
can reach (a shared filesystem or an object store) and every worker needs the target locally.

Trade-off: on a 2-core machine a LocalCluster adds orchestration, not speed; the point is the same
code on a real cluster, where each worker holds a GPU and its own engine.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_BACKENDS: dict[str, object] = {}


def _shard_task(cfg, target: str, store_uri: str, entries, gen, gen_id: str, think=None,
                trust_remote_code: bool = False) -> dict:
    """Runs on a worker. Hook for the fault tests: ``EAGLENEST_TEST_SHARD_STARTED`` names a
    directory where the task drops ``<pid>`` before working, so a test can kill that process."""
    from eaglenest.ingest.build import make_backend, run_shard

    marker_dir = os.environ.get("EAGLENEST_TEST_SHARD_STARTED")
    if marker_dir:
        open(os.path.join(marker_dir, f"{os.getpid()}-{entries[0].sample_id}"), "w").close()
    key = repr((cfg, target, trust_remote_code))
    if key not in _BACKENDS:
        _BACKENDS[key] = make_backend(cfg, target, trust_remote_code=trust_remote_code)
    backend = _BACKENDS[key]
    before = getattr(backend, "retries", 0)
    res = run_shard(backend, store_uri, entries, gen, gen_id, think=think)
    res["retries"] = getattr(backend, "retries", 0) - before
    return res


def client_for(cfg):
    """A connected ``distributed.Client`` (closing it also closes a LocalCluster it started)."""
    from eaglenest.errors import require

    distributed = require("distributed", "dask")
    import dask

    if cfg.dask_scheduler:
        return distributed.Client(cfg.dask_scheduler)
    # Workers must be allowed children: an in-process vLLM engine spawns its engine-core process.
    dask.config.set({"distributed.worker.daemon": False})
    cluster = distributed.LocalCluster(n_workers=cfg.dask_workers, threads_per_worker=1, processes=True,
                                       dashboard_address=None, host="127.0.0.1")
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


def run(shards, *, cfg, target, store_uri, gen, gen_id, on_result, client=None, think=None,
        trust_remote_code: bool = False) -> None:
    """Submit every shard; call ``on_result(k, result)`` on the driver as each finishes."""
    from distributed import as_completed

    own = client is None
    client = client or client_for(cfg)
    try:
        futures = {client.submit(_shard_task, cfg, target, store_uri, shard, gen, gen_id, think, trust_remote_code,
                                 pure=False, key=f"ingest-shard-{k}-{shard[0].sample_id}"): k
                   for k, shard in enumerate(shards)}
        for fut in as_completed(futures):
            on_result(futures[fut], fut.result())
    finally:
        if own:
            close(client)
