"""One shard of ``ingest build``: the unit an executor runs, wherever it runs it.

A shard's prompts are regenerated through a backend and written as Lance fragments of the prompts
table, not committed: committing is the driver's (``build.py``), so a shard lost with its process
leaves no visible row. Both executors use these functions, the in-process one (``build.py``) and the
Dask one (``dask_executor.py``, on a worker, which keeps its backend between shards); neither
executor module imports the other.
"""

from __future__ import annotations

import pyarrow as pa

from eaglenest.engine import make_llm
from eaglenest.errors import StoreError
from eaglenest.featurestore import schema
from eaglenest.featurestore.table import store
from eaglenest.featurestore.table.fragments import write_fragment
from eaglenest.ingest import backends
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.pool import PoolEntry
from eaglenest.ingest.regen import regenerate


def make_backend(cfg: IngestConfig, target: str, *, trust_remote_code: bool = False):
    """The backend ``ingest.backend`` names: OpenAI-compatible endpoints, or an in-process engine."""
    if cfg.backend == "endpoints":
        return backends.EndpointBackend(
            cfg.endpoints, target=target, api_key_env=cfg.api_key_env, timeout_s=cfg.request_timeout_s,
            max_retries=cfg.max_retries, backoff_s=cfg.retry_backoff_s,
            in_flight_per_endpoint=cfg.in_flight_per_endpoint, allow_remote=cfg.allow_remote_endpoints,
            max_in_flight=cfg.max_in_flight, allow_plaintext_key=cfg.allow_plaintext_api_key,
            chat_template_kwargs=cfg.chat_template_kwargs, trust_remote_code=trust_remote_code)
    llm = make_llm(target, cfg.engine, trust_remote_code=trust_remote_code, where="ingest.engine")
    return backends.LocalBackend(llm,
                                 max_in_flight=cfg.max_in_flight, chat_template_kwargs=cfg.chat_template_kwargs)


def write_rows(store_uri: str, rows: list[dict]) -> list:
    """Fragments of ``rows`` for the prompts table (no commit; runs in any process)."""
    return write_fragment(store_uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=schema.PROMPTS_SCHEMA))


def guarded(fn, store_uri: str):
    """Turn an OS-level write failure (disk full, permissions) into one clear line; nothing committed.
    Used wherever a shard is written, so a Dask worker's failure reaches the driver as that line too."""
    try:
        return fn()
    except OSError as exc:
        raise StoreError(f"run.store: cannot write the prompts table in {store_uri}: "
                         f"{str(exc).splitlines()[0][:300]}; no partial version was committed") from None


def shard_result(fragments: list, rows: list[dict], failures: list[dict], dropped: list[dict] = ()) -> dict:
    """What an executor reports for one shard (its written, uncommitted fragments and counts)."""
    return {"fragments": fragments, "rows": len(rows), "failures": failures, "dropped": list(dropped),
            "tokens": sum(len(r["response_token_ids"]) for r in rows)}


def run_shard(backend, store_uri: str, entries: list[PoolEntry], gen: Generation, gen_id: str, *,
              think=None) -> dict:
    """Regenerate one shard and write its fragments (not committed): the unit an executor runs."""
    dropped: list[dict] = []
    rows, failures = regenerate(backend, entries, gen, gen_id, think=think, dropped=dropped)
    return shard_result(guarded(lambda: write_rows(store_uri, rows), store_uri) if rows else [], rows, failures,
                        dropped)
