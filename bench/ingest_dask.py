"""Dask executor versus in-process ingest on the same prompts: honest scaling numbers.

    .venv/bin/python bench/ingest_dask.py [--prompts 256] [--rounds 3] [--workers 2] [--commit-every 32]
                                          [--scheduler tcp://HOST:8786] [--cold]

Warm arms (engines already started, start-up not timed), order alternating, each into a fresh store:

* ``inprocess``: ``ingest.build.build`` with one in-process engine (prompts streamed across shards).
* ``dask``: the same call with ``ingest.executor=dask`` on a client whose workers each already hold
  an engine (a LocalCluster of ``--workers`` processes, or the running cluster at ``--scheduler``);
  each shard of ``--commit-every`` prompts is one task, committed by the driver as it completes.

``--cold`` adds one timed run of each from nothing (engine, cluster and engines started inside).
Throughput = generated tokens / wall time; prints the ratio dask / inprocess as median [min, max].
On one 2-core machine both arms share the same two cores, so the ratio shows orchestration cost,
not scaling; on a cluster each worker brings its own GPU (see docs/ingest.md, "On a real cluster").
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

# The set-up the ingest benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_ingest_common", Path(__file__).with_name("ingest_common.py"))
C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(C)


def main() -> None:
    ap = C.add_args(argparse.ArgumentParser())
    ap.add_argument("--workers", type=at_least(1), default=2, help="LocalCluster workers")
    ap.add_argument("--commit-every", type=at_least(1), default=32, help="prompts per shard (one task)")
    ap.add_argument("--scheduler", default="", help="a running Dask scheduler (default: a LocalCluster)")
    ap.add_argument("--store", default="", help="store root every worker can reach (default: a temp dir)")
    ap.add_argument("--cold", action="store_true", help="add one timed run of each from nothing (engines started)")
    a = ap.parse_args()

    from eaglenest.config import build as build_cfg
    from eaglenest.ingest import dask_executor
    from eaglenest.ingest.build import build, chat_template
    from eaglenest.ingest.shard import make_backend
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.regen import gen_params_id

    manifest, pool = C.load_prompts(a)
    engine = {"max_model_len": 1024, "max_num_seqs": a.max_num_seqs, "memory_fraction": 0.05}
    common = {"commit_every": a.commit_every, "engine": engine}
    inproc = build_cfg(IngestConfig, common)
    dask_cfg = build_cfg(IngestConfig, {**common, "executor": "dask", "dask_workers": a.workers,
                                        "dask_scheduler": a.scheduler})
    scratch = Path(a.store or tempfile.mkdtemp(prefix="bench-ingest-dask-"))
    try:
        target = str(Path(a.target).resolve())

        def run(name: str, cfg, **kw) -> tuple[float, int]:
            uri = str(scratch / f"{name}-{time.monotonic_ns()}")
            t0 = time.perf_counter()
            stats = build(manifest, pool, target=target, store_uri=uri, cfg=cfg, **kw)
            dt = time.perf_counter() - t0
            assert stats["regenerated"] == len(pool) and stats["failed"] == 0, stats
            return dt, stats["generated_tokens"]

        if a.cold:
            for name, cfg in (("inprocess", inproc), ("dask", dask_cfg)):
                dt, n = run(f"cold-{name}", cfg)
                print(f"cold {name}: {dt:.1f} s for {n} tokens (engine / cluster start included)", flush=True)

        backend = make_backend(inproc, target)
        client = dask_executor.client_for(dask_cfg)
        workers = sorted(client.scheduler_info()["workers"])
        gen_id = gen_params_id(manifest.generation, chat_template(target))
        # One engine per worker, started before timing (a one-prompt shard pinned to each worker). The
        # store folder must exist first, as dask_executor.run makes it: each worker checks it can see it.
        warm = scratch / "warm"
        warm.mkdir(parents=True, exist_ok=True)
        client.gather([client.submit(dask_executor._shard_task, dask_cfg, target, str(warm), pool[:1],
                                     manifest.generation, gen_id, workers=[w], pure=False) for w in workers])
        arms = {"inprocess": lambda: run("inprocess", inproc, backend=backend),
                "dask": lambda: run("dask", dask_cfg, client=client)}
        arms["inprocess"]()  # warm-up of the driver side
        tps: dict[str, list[float]] = {n: [] for n in arms}
        for r in range(a.rounds):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order:
                dt, n = arms[name]()
                tps[name].append(n / dt)
            print(f"round {r} ({' -> '.join(order)}): " + "  ".join(f"{n} {tps[n][-1]:.0f} tok/s" for n in arms),
                  flush=True)
        dask_executor.close(client)
        backend.close()
    finally:  # also on Ctrl-C, SIGTERM (run_unwinding) or a failed round: no scratch stores left behind
        if not a.store:
            shutil.rmtree(scratch, ignore_errors=True)
    ratios = [d / i for d, i in zip(tps["dask"], tps["inprocess"])]
    print(f"prompts={len(pool)} commit_every={a.commit_every} workers={len(workers)} "
          f"scheduler={a.scheduler or 'LocalCluster'} rounds={a.rounds}")
    print(f"dask/inprocess = {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]   "
          f"(dask {statistics.median(tps['dask']):.0f} tok/s, inprocess {statistics.median(tps['inprocess']):.0f} tok/s)")


if __name__ == "__main__":
    sys.exit(C.run_unwinding(main))
