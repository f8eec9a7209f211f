"""Bounded-memory feature writes: rows become Lance fragments once they hold ``budget`` bytes.

At realistic shapes a sample's hidden states are tens of MB (1-2K tokens x 4 x 4096 x bf16 is
32-64 MB), so holding a whole commit's rows (``featurestore.commit_every`` samples) before writing
them would need GBs. :class:`FeatureWriter` keeps at most ``budget`` bytes of encoded rows: when
they reach it, they are written as a fragment (data files, no commit; ``fragments.write_fragment``)
and dropped. :meth:`FeatureWriter.commit` writes the rest and appends every fragment of the commit
in one atomic Lance commit, so readers and resumed runs see the same commit boundaries as before:
all of a commit's rows, or none. Fragments of a commit that never happens (a killed run) are
invisible garbage for ``featurestore gc``.

Capture's engine window (``Capturer.stream``) is cut to the same byte budget, so captured tensors
waiting to be encoded are bounded too.
Peak memory is therefore about three times the budget (captured tensors, encoded rows, the Arrow
table being written), or three times the largest sample when a sample alone is larger than the
budget (a single sample is never split).
``bench/featurestore_write.py --rss`` measures it.
"""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path

import pyarrow as pa

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import fragments


def bytes_per_token(meta: S.FeatureMeta) -> int:
    """Stored bytes of one token's hidden states (aux layers + last) in ``meta``'s storage."""
    if meta.storage == "fp8_e4m3":
        return (len(meta.layer_ids) + 1) * (meta.hidden_size + 4)
    return captured_bytes_per_token(meta)


def captured_bytes_per_token(meta: S.FeatureMeta) -> int:
    """Bytes of one token's hidden states as the engine hands them over (aux layers + last, in the
    target's dtype), whatever the storage: what the capture window holds before encoding."""
    return (len(meta.layer_ids) + 1) * meta.hidden_size * S._DTYPES[meta.dtype].itemsize


class FeatureWriter:
    """Rows of one commit, written as fragments every ``budget`` bytes, committed together."""

    def __init__(self, uri: str, name: str, meta: S.FeatureMeta, *, budget: int):
        if budget < 1:
            raise ValueError(f"write budget must be >= 1 byte, got {budget}")
        self.uri, self.name, self.meta, self.budget = uri, name, meta, budget
        self.schema = S.features_schema(meta)
        self._rows: list[dict] = []
        self._bytes = 0
        self._frags: list = []
        self._counts: collections.Counter = collections.Counter()
        #: Fragments written so far by this writer (all commits).
        self.fragments_written = 0
        #: Names of the data files (under ``<table>.lance/data/``) this writer wrote, all commits: what a
        #: failed import that created the table removes again, and nothing another writer wrote.
        self.data_files: list[str] = []

    def add(self, row: dict) -> None:
        """Buffer one ``build.feature_row``; writes a fragment when the buffer reaches the budget."""
        self._rows.append(row)
        self._bytes += len(row["aux_hidden"]) + len(row["last_hidden"])
        self._counts[row["domain"]] += 1
        if self._bytes >= self.budget:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        table = pa.Table.from_pylist(self._rows, schema=self.schema)
        self._rows, self._bytes = [], 0  # the table holds the bytes now; the rows can go
        with _write_errors(self.uri, self.name):
            frags = fragments.write_fragment(self.uri, self.name, table, meta=self.meta)
        self.fragments_written += len(frags)
        self._frags += frags
        self.data_files += [Path(f.path).name for frag in frags for f in frag.files]

    def commit(self, lineage: dict | None = None) -> int | None:
        """Write what is buffered and append this commit's fragments atomically. ``lineage`` gets
        ``counts_per_domain`` of the commit's rows. Returns the new version (None: nothing to add)."""
        self._flush()
        frags, counts = self._frags, self._counts
        self._frags, self._counts = [], collections.Counter()
        if not frags:
            return None
        lineage = {**(lineage or {}), "counts_per_domain": dict(sorted(counts.items()))}
        with _write_errors(self.uri, self.name):
            return fragments.commit_fragments(self.uri, self.name, frags, meta=self.meta, lineage=lineage)


@contextlib.contextmanager
def _write_errors(uri: str, name: str):
    """An OS-level write failure (disk full, file too large, permissions) as one clear line. The
    commit in progress is not made, so the table stays at its last version; what was written of it
    is uncommitted garbage for ``featurestore gc``."""
    try:
        yield
    except OSError as exc:
        first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise StoreError(f"cannot write table '{name}' in {uri}: {first}; nothing of this commit was "
                         "committed (the table keeps its last version): free space or fix the store and "
                         "re-run, which resumes") from None
