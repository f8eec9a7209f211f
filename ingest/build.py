"""``ingest build``: manifest -> prompt pool -> on-policy responses in the store's ``prompts`` table.

Resumable by construction: sample ids are content hashes, every chunk of ``commit_every`` prompts is
one atomic Lance commit, and a re-run skips ids already in the table, so a killed run loses at most
the chunk in flight and never duplicates a row. No engine is started when nothing is left to do.
"""

from __future__ import annotations

import collections
import logging
import time

import pyarrow as pa
from tqdm import tqdm

from eaglenest.featurestore import schema, store
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import PoolEntry
from eaglenest.ingest.regen import gen_params_id, heldout_row, regenerate

log = logging.getLogger(__name__)


def chat_template(target: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    return tok.chat_template or ""


def build(manifest: Manifest, pool: list[PoolEntry], *, target: str, store_uri: str, engine,
          commit_every: int) -> dict:
    """Regenerate what is missing from the prompts table; return the run's stats."""
    t0 = time.time()
    gen_id = gen_params_id(manifest.generation, chat_template(target))
    done = store.sample_ids(store_uri, store.PROMPTS)
    todo = [e for e in pool if e.sample_id not in done]
    heldout = [e for e in todo if e.split == "heldout"]
    train = [e for e in todo if e.split == "train"]
    if heldout:
        _commit(store_uri, [heldout_row(e, gen_id) for e in heldout])
    generated_tokens = 0
    if train:
        from eaglenest.engine import make_llm

        llm = make_llm(target, engine)
        with tqdm(total=len(train), desc="ingest: regenerate", unit="prompt") as bar:
            for i in range(0, len(train), commit_every):
                rows = regenerate(llm, train[i:i + commit_every], manifest.generation, gen_id)
                _commit(store_uri, rows)
                n = sum(len(r["response_token_ids"]) for r in rows)
                generated_tokens += n
                bar.update(len(rows))
                bar.set_postfix(tok_s=f"{generated_tokens / max(time.time() - t0, 1e-9):.0f}")
    table = store.read(store_uri, store.PROMPTS, columns=["domain", "split", "finish_reason"])
    counts = collections.Counter(zip(table.column("domain").to_pylist(), table.column("split").to_pylist()))
    truncated = sum(1 for f in table.column("finish_reason").to_pylist() if f == "length")
    return {
        "manifest": manifest.name, "manifest_hash": manifest.content_hash(), "gen_params_id": gen_id,
        "pool_size": len(pool), "skipped_existing": len(pool) - len(todo),
        "regenerated": len(train), "heldout_written": len(heldout), "generated_tokens": generated_tokens,
        "truncated_responses": truncated,
        "counts": {f"{d}/{s}": n for (d, s), n in sorted(counts.items())},
        "prompts_table_version": store.latest_version(store_uri, store.PROMPTS),
        "seconds": round(time.time() - t0, 2),
    }


def _commit(store_uri: str, rows: list[dict]) -> None:
    store.append(store_uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=schema.PROMPTS_SCHEMA))
