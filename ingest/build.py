"""``ingest build``: manifest -> prompt pool -> on-policy responses in the store's ``prompts`` table.

Resumable and exactly-once by construction: sample ids are content hashes; the training prompts
still missing from the table are cut into shards of ``commit_every``; each shard's rows are written
as Lance fragments (by whichever process ran it) and committed by this driver in one Append commit
as the shard finishes. Shards are a unit of commit, not of generation: in-process, every prompt
streams through one engine with a bounded number in flight (``ingest.max_in_flight``), and a shard
is written and committed the moment its last prompt is answered, while the engine (its own
process) goes on with the next prompts; no batch barrier, no idle engine during commits. A re-run
skips ids already in the table. So a killed run loses at most the shards in flight (their fragments
are uncommitted garbage, never visible), and a shard whose Dask worker died is simply run again
elsewhere, its lost fragments never committed: no row can appear twice. Failed prompts (backend
errors after retries) are not written, reported per prompt in the stats, and retried by the next
run. No engine is started when nothing is left to do.
"""

from __future__ import annotations

import collections
import logging
import time

import pyarrow as pa
from tqdm import tqdm

from eaglenest import faults
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema, store
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation, Manifest
from eaglenest.ingest.pool import PoolEntry
from eaglenest.ingest.regen import gen_params_id, heldout_row, regenerate, stream

log = logging.getLogger(__name__)


def chat_template(target: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return tok.chat_template or ""


def make_backend(cfg: IngestConfig, target: str):
    from eaglenest.ingest import backends

    if cfg.backend == "endpoints":
        return backends.EndpointBackend(
            cfg.endpoints, target=target, api_key_env=cfg.api_key_env, timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries, backoff_s=cfg.retry_backoff_s,
            in_flight_per_endpoint=cfg.in_flight_per_endpoint, allow_remote=cfg.allow_remote_endpoints,
            max_in_flight=cfg.max_in_flight, allow_plaintext_key=cfg.allow_plaintext_api_key)
    from eaglenest.engine import make_llm

    return backends.LocalBackend(make_llm(target, cfg.engine), max_in_flight=cfg.max_in_flight)


def write_rows(store_uri: str, rows: list[dict]) -> list:
    """Fragments of ``rows`` for the prompts table (no commit; runs in any process)."""
    from eaglenest.featurestore.fragments import write_fragment

    return write_fragment(store_uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=schema.PROMPTS_SCHEMA))


def commit(store_uri: str, fragments: list, lineage: dict) -> int:
    from eaglenest.featurestore.fragments import commit_fragments

    return commit_fragments(store_uri, store.PROMPTS, fragments, lineage=lineage)


def shard_result(fragments: list, rows: list[dict], failures: list[dict]) -> dict:
    """What an executor reports for one shard (its written, uncommitted fragments and counts)."""
    return {"fragments": fragments, "rows": len(rows), "failures": failures,
            "tokens": sum(len(r["response_token_ids"]) for r in rows)}


def run_shard(backend, store_uri: str, entries: list[PoolEntry], gen: Generation, gen_id: str) -> dict:
    """Regenerate one shard and write its fragments (not committed): the unit an executor runs."""
    rows, failures = regenerate(backend, entries, gen, gen_id)
    return shard_result(write_rows(store_uri, rows) if rows else [], rows, failures)


def build(manifest: Manifest, pool: list[PoolEntry], *, target: str, store_uri: str, cfg: IngestConfig,
          backend=None, client=None) -> dict:
    """Regenerate what is missing from the prompts table; return the run's stats.

    ``backend`` (in-process executor) or ``client`` (a ``distributed.Client``, Dask executor) reuse a
    running engine or cluster instead of starting one; the caller keeps and closes it. The run holds
    the prompts table's writer lease throughout (``featurestore/lease.py``): what is missing is
    decided once at the start and stays true, so two ingests at once cannot both regenerate and
    append the same prompts; the second is refused, naming the first.
    """
    from eaglenest.featurestore import lease

    with lease.hold(store_uri, store.PROMPTS, purpose="ingest build", wait_s=5):
        return _build(manifest, pool, target=target, store_uri=store_uri, cfg=cfg, backend=backend, client=client)


def _build(manifest: Manifest, pool: list[PoolEntry], *, target: str, store_uri: str, cfg: IngestConfig,
           backend=None, client=None) -> dict:
    t0 = time.time()
    gen_id = gen_params_id(manifest.generation, chat_template(target))
    try:
        done = store.sample_ids(store_uri, store.PROMPTS)
    except OSError as exc:
        raise StoreError(f"run.store_uri: cannot read the prompts table in {store_uri} ({exc})") from None
    todo = [e for e in pool if e.sample_id not in done]
    heldout = [e for e in todo if e.split == "heldout"]
    train = [e for e in todo if e.split == "train"]
    lineage = {"stage": "ingest", "manifest": manifest.name, "manifest_hash": manifest.content_hash(),
               "gen_params_id": gen_id}
    if heldout:
        _guarded(lambda: commit(store_uri, write_rows(store_uri, [heldout_row(e, gen_id) for e in heldout]),
                                {**lineage, "shard": "heldout"}), store_uri)
    shards = [train[i:i + cfg.commit_every] for i in range(0, len(train), cfg.commit_every)]
    totals = {"rows": 0, "tokens": 0, "failures": [], "retries": 0}
    if shards:
        runner = _run_dask if cfg.executor == "dask" else _run_inprocess
        # disable=None: no bar when stderr is not a terminal (logs keep one line per event)
        with tqdm(total=len(train), desc="ingest: regenerate", unit="prompt", disable=None) as bar:
            def on_result(k: int, res: dict) -> None:
                if res["fragments"]:
                    faults.delay("ingest.before_commit")  # tests: hold the fragments-written window
                    _guarded(lambda: commit(store_uri, res["fragments"], {**lineage, "shard": k}), store_uri)
                totals["rows"] += res["rows"]
                totals["tokens"] += res["tokens"]
                totals["failures"] += res["failures"]
                totals["retries"] += res.get("retries", 0)
                bar.update(len(shards[k]))
                bar.set_postfix(tok_s=f"{totals['tokens'] / max(time.time() - t0, 1e-9):.0f}",
                                failed=len(totals["failures"]))

            extra = {"client": client} if cfg.executor == "dask" else {"backend": backend}
            runner(shards, cfg=cfg, target=target, store_uri=store_uri, gen=manifest.generation,
                   gen_id=gen_id, on_result=on_result, **extra)
    columns = ["domain", "split", "finish_reason"]
    stored = store.exists(store_uri, store.PROMPTS)  # not when nothing was held out and every request failed
    table = (store.read(store_uri, store.PROMPTS, columns=columns) if stored
             else schema.PROMPTS_SCHEMA.empty_table().select(columns))
    counts = collections.Counter(zip(table.column("domain").to_pylist(), table.column("split").to_pylist()))
    truncated = sum(1 for f in table.column("finish_reason").to_pylist() if f == "length")
    return {
        "manifest": manifest.name, "manifest_hash": manifest.content_hash(), "gen_params_id": gen_id,
        "backend": cfg.backend, "executor": cfg.executor, "shards": len(shards),
        "pool_size": len(pool), "skipped_existing": len(pool) - len(todo),
        "regenerated": totals["rows"], "heldout_written": len(heldout), "generated_tokens": totals["tokens"],
        "failed": len(totals["failures"]), "failures": totals["failures"], "retries": totals["retries"],
        "truncated_responses": truncated,
        "weights": {d: c.weight for d, c in manifest.domains.items()},
        "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())},
        "prompts_table_version": store.latest_version(store_uri, store.PROMPTS) if stored else None,
        "seconds": round(time.time() - t0, 2),
    }


def _guarded(fn, store_uri: str):
    """Turn an OS-level write failure (disk full, permissions) into one clear line; nothing committed."""
    try:
        return fn()
    except OSError as exc:
        raise StoreError(f"run.store_uri: cannot write the prompts table in {store_uri}: "
                         f"{str(exc).splitlines()[0][:300]}; no partial version was committed") from None


def _run_inprocess(shards, *, cfg, target, store_uri, gen, gen_id, on_result, backend=None) -> None:
    """Stream every shard's prompts through one backend; write + commit each shard as it completes."""
    own = backend is None
    backend = backend or make_backend(cfg, target)
    where = {e.sample_id: (k, i) for k, shard in enumerate(shards) for i, e in enumerate(shard)}
    left = [len(s) for s in shards]
    rows: dict[int, dict[int, dict]] = {k: {} for k in range(len(shards))}
    failures: dict[int, list] = {k: [] for k in range(len(shards))}
    retries = getattr(backend, "retries", 0)
    try:
        for e, r, err in stream(backend, (e for shard in shards for e in shard), gen, gen_id):
            k, i = where[e.sample_id]
            if r is None:
                failures[k].append({"sample_id": e.sample_id, "error": err})
            else:
                rows[k][i] = r
            left[k] -= 1
            if left[k]:
                continue
            got = rows.pop(k)
            done = [got[i] for i in sorted(got)]  # entry order: the same fragments as a batch run
            res = shard_result(_guarded(lambda: write_rows(store_uri, done), store_uri) if done else [],
                               done, failures.pop(k))
            now = getattr(backend, "retries", 0)
            res["retries"], retries = now - retries, now
            on_result(k, res)
    finally:
        if own:
            backend.close()


def _run_dask(shards, *, cfg, target, store_uri, gen, gen_id, on_result, client=None) -> None:
    from eaglenest.ingest import dask_executor

    dask_executor.run(shards, cfg=cfg, target=target, store_uri=store_uri, gen=gen, gen_id=gen_id,
                      on_result=on_result, client=client)
