"""``ingest build`` on a real Dask cluster: ``dask scheduler`` and two ``dask worker`` processes
started with Dask's own command line on loopback, as a cluster runs them (nanny, worker process,
own working directory), and the driver is the ``ingest build`` CLI in its own process.

One cluster for the module (module-scoped fixture); each worker starts one vLLM engine of the tiny
target (memory_fraction 0.1, tiny caps), so at most two engines are alive at once, and keeps it
warm: the kill test reuses both engines. Killing a worker is what Dask's nanny is for: it starts
a new worker process within seconds, and the scheduler reruns the lost shard on whichever worker
has a free thread first (the survivor's warm engine, or the new worker, which starts an engine).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.table import store
from eaglenest.ingest import contamination
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.dask_executor import check_worker
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool

DASK = Path(sys.executable).parent / "dask"
#: Seconds a worker holds the "fragments written, result not yet returned" window open.
WRITTEN_WINDOW_S = 1.5
ENGINE = ["ingest.engine.memory_fraction=0.1", "ingest.engine.max_model_len=512", "ingest.engine.max_num_seqs=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End a process started in its own session, and everything in its group."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            if sig == signal.SIGTERM:  # the group may still hold the worker's engine processes
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(address, client, dirs)``: a scheduler and two single-thread workers, each its own process group."""
    import distributed

    base = tmp_path_factory.mktemp("dask-cluster")
    dirs = {k: base / k for k in ("started", "written", "logs")}
    for d in dirs.values():
        d.mkdir()
    addr = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False",  # workers start vLLM's processes
           "EAGLENEST_TEST_SHARD_STARTED": str(dirs["started"]), "EAGLENEST_TEST_SHARD_WRITTEN": str(dirs["written"]),
           "EAGLENEST_FAULT_DELAY": f"ingest.shard_written={WRITTEN_WINDOW_S}", "VLLM_LOGGING_LEVEL": "WARNING"}
    procs, client = [], None

    def start(name: str, *argv: str) -> None:
        cwd = base / name  # not the repo: relative paths from the driver must not resolve here
        cwd.mkdir()
        log = open(dirs["logs"] / f"{name}.log", "w")
        procs.append(subprocess.Popen([str(DASK), *argv], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))

    try:
        start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", addr.rsplit(":", 1)[1], "--no-dashboard")
        for i in range(2):
            start(f"worker{i}", "worker", addr, "--nworkers", "1", "--nthreads", "1", "--no-dashboard",
                  "--name", f"w{i}", "--host", "127.0.0.1")
        client = distributed.Client(addr, timeout=60)
        client.wait_for_workers(2, timeout=120)
        yield addr, client, dirs
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            _stop(p)


def _ingest(root, manifest, work, *overrides, timeout=420) -> subprocess.CompletedProcess:
    """The real CLI in its own process; ``run.target`` stays the recipe's relative ``assets/tiny-target``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLENEST_")}
    return subprocess.run([sys.executable, "-m", "eaglenest.ingest.cli", "build", "--manifest", str(manifest),
                           f"run.workdir={work}", *overrides], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _dask(addr):
    return ["ingest.executor=dask", f"ingest.dask_scheduler={addr}", "ingest.commit_every=4", *ENGINE]


def _clear(dirs) -> set[int]:
    """Forget the shard markers of earlier tests (shard names repeat); returns the pids they name."""
    pids = set()
    for k in ("started", "written"):
        for f in dirs[k].iterdir():
            pids.add(int(f.name.split("-", 1)[0]))
            f.unlink()
    return pids


def _pool_ids(root, manifest) -> list[str]:
    """The ids `ingest build` stores: the pool less what the contamination check drops."""
    m = load_manifest(manifest)
    pool, _ = contamination.check(load_pool(m, target=str(root / "assets/tiny-target")), m)
    return sorted(e.sample_id for e in pool)


def _ids(work) -> list[str]:
    return store.read(str(work / "store"), store.PROMPTS, columns=["sample_id"]).column("sample_id").to_pylist()


def _stats(work) -> dict:
    return json.loads((work / "ingest" / "stats.json").read_text())


@pytest.mark.slow
def test_build_on_dask_cli_cluster_stores_every_prompt_once(cluster, root, tmp_path, small_manifest):
    addr, _, dirs = cluster
    caps, write = small_manifest
    m = write(tmp_path / "m.yaml", root, max_tokens=8)
    _clear(dirs)
    t0 = time.time()
    res = _ingest(root, m, tmp_path / "work", *_dask(addr))
    assert res.returncode == 0, res.stderr[-3000:]
    ids, pool = _ids(tmp_path / "work"), _pool_ids(root, m)
    assert len(ids) == len(set(ids)) and sorted(ids) == pool and len(pool) == sum(caps.values())
    stats = _stats(tmp_path / "work")
    assert stats["executor"] == "dask" and stats["failed"] == 0 and stats["shards"] == 5
    assert stats["regenerated"] + stats["heldout_written"] == len(pool) and stats["generated_tokens"] > 0
    t = store.read(str(tmp_path / "work" / "store"), store.PROMPTS)
    assert all(r["response_token_ids"] for r in t.to_pylist() if r["split"] == "train")
    # The shards ran on both worker processes (dask worker's children), not in the driver.
    pids = {int(f.name.split("-", 1)[0]) for f in dirs["written"].iterdir()}
    assert len(pids) == 2
    print(f"dask-cli build: {len(pool)} prompts, {stats['shards']} shards, {time.time() - t0:.1f} s "
          f"(engine starts included)")


def _descendants(pid: int) -> set[int]:
    parent = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_worker_killed_mid_shard_loses_and_duplicates_nothing(cluster, root, tmp_path, small_manifest):
    addr, client, dirs = cluster
    caps, write = small_manifest
    m = write(tmp_path / "m.yaml", root, max_tokens=8)
    before = _clear(dirs)
    killed: dict = {}
    done = threading.Event()

    def killer():  # SIGKILL the first worker process whose shard is written but not yet returned
        while not done.is_set():
            new = [f.name for f in dirs["written"].iterdir()]
            if new:
                pid, shard = new[0].split("-", 1)
                killed["engine"] = _descendants(int(pid))
                os.kill(int(pid), signal.SIGKILL)
                killed.update(pid=int(pid), shard=shard, at=time.time())
                return
            time.sleep(0.01)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    work = tmp_path / "work"
    try:
        res = _ingest(root, m, work, *_dask(addr))
    finally:
        done.set()
        th.join()
    assert res.returncode == 0, res.stderr[-3000:]
    assert killed, "no shard was written"
    # The killed worker's vLLM engine processes did not outlive it (its reaper ended them).
    assert killed["engine"], "the killed worker had no engine processes"
    while any(map(_alive, killed["engine"])) and time.time() < killed["at"] + 20:
        time.sleep(0.2)
    assert not any(map(_alive, killed["engine"])), "the killed worker's engine processes outlived it"
    # The killed shard ran again, in another worker process, and its first fragments stay uncommitted.
    reruns = [int(f.name.split("-", 1)[0]) for f in dirs["started"].iterdir() if f.name.split("-", 1)[1] == killed["shard"]]
    assert killed["pid"] in reruns and any(p != killed["pid"] for p in reruns)
    import lance

    path = store.table_path(str(work / "store"), store.PROMPTS)
    committed = {str(d.path) for f in lance.dataset(str(path)).get_fragments() for d in f.data_files()}
    orphans = [p.name for p in (path / "data").iterdir() if p.name not in committed]
    assert orphans, "the kill did not land after the shard's fragments were written"
    ids, pool = _ids(work), _pool_ids(root, m)
    assert len(ids) == len(set(ids)) and sorted(ids) == pool and len(pool) == sum(caps.values())
    stats = _stats(work)
    assert stats["failed"] == 0 and stats["regenerated"] + stats["heldout_written"] == len(pool)
    version = stats["prompts_table_version"]
    # Dask's nanny replaced the killed worker process: the cluster is back to two workers.
    client.wait_for_workers(2, timeout=60)
    rerun_pid = next(p for p in reruns if p != killed["pid"])
    survivor = rerun_pid in before
    print(f"killed worker pid {killed['pid']} with shard {killed['shard']} written, not returned; rerun by "
          f"{'the surviving' if survivor else 'a new'} worker process (pid {rerun_pid}); {len(orphans)} uncommitted "
          f"fragment file(s) left behind")
    # A re-run adds nothing: every prompt is there, no shard is submitted, no new version.
    again = _ingest(root, m, work, *_dask(addr))
    assert again.returncode == 0, again.stderr[-3000:]
    stats = _stats(work)
    assert stats["regenerated"] == 0 and stats["shards"] == 0 and stats["skipped_existing"] == len(pool)
    assert stats["prompts_table_version"] == version and sorted(_ids(work)) == pool


def test_unreachable_scheduler_fails_fast_with_one_line(root, tmp_path, small_manifest):
    _, write = small_manifest
    m = write(tmp_path / "m.yaml", root)
    addr = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.time()
    res = _ingest(root, m, tmp_path / "work", "ingest.executor=dask", f"ingest.dask_scheduler={addr}", timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"ingest: error: ingest.dask_scheduler: cannot reach a Dask scheduler at {addr} ")
    assert time.time() - t0 < 60
    assert not store.exists(str(tmp_path / "work" / "store"), store.PROMPTS)  # nothing was written


def test_worker_checks_name_what_a_cluster_gets_wrong(tmp_path, tiny_target):
    cfg = IngestConfig()
    check_worker(cfg, str(tiny_target), str(tmp_path))  # a worker that sees both: fine
    with pytest.raises(ConfigError, match=r"^run.target: /nowhere/target does not exist on Dask worker "):
        check_worker(cfg, "/nowhere/target", str(tmp_path))
    with pytest.raises(StoreError, match=r"^run.store: /nowhere/store is not visible on Dask worker "):
        check_worker(cfg, str(tiny_target), "/nowhere/store")
    check_worker(cfg, "org/hub-model", "s3://bucket/store")  # a hub id and an object store: not paths here
    # A daemonic process (dask worker's default under its nanny) cannot start vLLM's engine processes.
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # pool workers are daemonic
        with pytest.raises(ConfigError, match=r"DASK_DISTRIBUTED__WORKER__DAEMON=False"):
            pool.apply(check_worker, (cfg, str(tiny_target), str(tmp_path)))
        pool.apply(check_worker, (IngestConfig(backend="endpoints", endpoints=["http://127.0.0.1:1"]),
                                  str(tiny_target), str(tmp_path)))  # HTTP clients start no processes


def test_worker_adopts_the_drivers_store_options(monkeypatch):
    """A Dask worker never resolved the recipe: the driver's options travel with the task, explicitly."""
    from eaglenest import runconfig
    from eaglenest.ingest.dask_executor import adopt_storage_options
    from eaglenest.runconfig import registered_storage_options, storage_options_for

    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})  # as on a fresh worker
    monkeypatch.setenv("TEST_S3_SECRET", "s3cr3t")
    assert storage_options_for("s3://bucket/store/prompts.lance") == {}
    sent = {"s3://bucket/store": {"aws_secret_access_key": "${TEST_S3_SECRET}", "region": "x"}}
    adopt_storage_options(sent)
    assert storage_options_for("s3://bucket/store/prompts.lance") == {"aws_secret_access_key": "s3cr3t", "region": "x"}
    assert registered_storage_options() == sent  # references only, never the secret
    adopt_storage_options({})  # nothing registered on the driver: nothing changes
    assert registered_storage_options() == sent
