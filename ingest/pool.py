"""The prompt pool: load sources, normalise, deduplicate, cap, and split held-out prompts.

Loading is the only I/O; everything after it is a pure function of the loaded records, so the same
manifest and sources always give the same pool. Order, the held-out split and the chat/raw choice
are all derived from a hash of the normalised content (never from file order or a random state),
so adding a source does not reshuffle the prompts already chosen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import unicodedata
from pathlib import Path

from eaglenest.errors import ManifestError
from eaglenest.ingest.manifest import Manifest, Source, resolve_path

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PoolEntry:
    sample_id: str
    domain: str
    source: str
    split: str     # "train" | "heldout"
    mode: str      # "chat" | "raw"
    system: str
    prompt: str

    def messages(self) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": self.prompt}]


def normalise(text: str) -> str:
    """Unicode NFKC, unified newlines, trimmed trailing spaces: what counts as 'the same prompt'."""
    text = unicodedata.normalize("NFKC", text).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.strip().split("\n"))


def content_key(text: str) -> str:
    """Hash used for deduplication and contamination checks: case- and whitespace-insensitive."""
    squashed = re.sub(r"\s+", " ", normalise(text).lower())
    return hashlib.sha256(squashed.encode()).hexdigest()


def _unit(key: str, salt: str) -> float:
    """A deterministic number in [0, 1) from a content key."""
    return int(hashlib.sha256(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def load_source(src: Source, *, where: str, base_dir: str | Path | None = None) -> list[dict]:
    """Rows of one source as dicts with ``prompt`` and ``system`` (I/O edge)."""
    if src.path:
        p = resolve_path(src.path, base_dir)
        if p.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(p).to_pylist()
        else:
            text = p.read_text(encoding="utf-8")
            try:
                rows = ([json.loads(line) for line in text.splitlines() if line.strip()]
                        if p.suffix == ".jsonl" else json.loads(text))
            except json.JSONDecodeError as exc:
                raise ManifestError(f"{where}.path: {p} is not valid JSON ({exc})") from None
        label = str(src.path)
    else:
        from eaglenest.errors import require

        datasets = require("datasets", "ingest")
        ds = datasets.load_dataset(src.hf_id, src.hf_config or None, split=src.hf_split)
        rows, label = list(ds), f"hf:{src.hf_id}/{src.hf_config or 'default'}/{src.hf_split}"
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or src.field not in row:
            raise ManifestError(f"{where}.field: row {i} of {label} has no column '{src.field}'")
        system = str(row.get(src.system_field) or "") if src.system_field else ""
        out.append({"prompt": str(row[src.field]), "system": system, "source": label})
    return out


def build_pool(manifest: Manifest, loaded: dict[str, list[dict]]) -> list[PoolEntry]:
    """Pure: the pool from the rows loaded per domain (``loaded[domain]``)."""
    pool: list[PoolEntry] = []
    seen: set[str] = set()
    for domain in manifest.domains:
        cands = {}
        for row in loaded.get(domain, []):
            prompt = normalise(row["prompt"])
            if not prompt:
                continue
            key = content_key(row["system"] + "\n" + prompt)
            if key in seen or key in cands:
                continue  # exact duplicate (also across domains: first domain wins)
            cands[key] = (prompt, normalise(row["system"]), row["source"])
        chosen = sorted(cands)[: manifest.domains[domain].cap_prompts]
        seen.update(chosen)
        for key in chosen:
            prompt, system, source = cands[key]
            heldout = _unit(key, "heldout") < manifest.held_out(domain)
            raw = not heldout and _unit(key, "raw") < manifest.raw(domain)
            pool.append(PoolEntry(sample_id=f"{domain}-{key[:16]}", domain=domain, source=source,
                                  split="heldout" if heldout else "train",
                                  mode="raw" if raw else "chat", system=system, prompt=prompt))
    return pool


def load_pool(manifest: Manifest, *, base_dir: str | Path | None = None) -> list[PoolEntry]:
    loaded = {
        name: [r for i, s in enumerate(d.sources)
               for r in load_source(s, where=f"domains.{name}.sources[{i}]", base_dir=base_dir)]
        for name, d in manifest.domains.items()
    }
    return build_pool(manifest, loaded)


def raw_text(entry: PoolEntry) -> str:
    """What a raw-completion request sends: the prompt as a plain document, no chat markup."""
    return (entry.system + "\n\n" if entry.system else "") + entry.prompt + "\n"
