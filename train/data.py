"""Training rows from the ``features`` table: decode, pack, pad.

The selected split is read once at a pinned version into an Arrow table (raw tensor bytes, the
compact form; decoding happens per batch). That keeps the loader trivially deterministic and
restartable; the trade-off is that the split must fit in RAM (the toy set does by far). A
streaming loader over ``store.iter_batches`` with the same packing would lift that limit.

Packing: each epoch shuffles sample order with ``seed + epoch``, then fills rows of at most
``pack_tokens`` tokens greedily (a longer sample is truncated to ``pack_tokens``). Documents in a
row carry their own ids and restart rotary positions at 0, so nothing attends across documents.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import torch

from eaglenest.errors import StoreError
from eaglenest.featurestore import schema as S
from eaglenest.train.ttt import Batch

log = logging.getLogger(__name__)

COLUMNS = ["input_ids", "loss_mask", "aux_hidden", "last_hidden"]


class PackedData:
    """Deterministic packed batches over an in-memory Arrow table of feature rows."""

    def __init__(self, table: pa.Table, meta: S.FeatureMeta, *, pack_tokens: int, batch_rows: int,
                 seed: int):
        if table.num_rows == 0:
            raise StoreError("features: no rows to train on (check train.split and the table version)")
        self.table = table
        self.meta = meta
        self.pack_tokens = pack_tokens
        self.batch_rows = batch_rows
        self.seed = seed
        self.lengths = np.asarray(table.column("input_ids").combine_chunks().value_lengths())
        # vLLM concatenates aux states in ascending layer order; reorder if the table does not.
        self.aux_order = torch.as_tensor(np.argsort(np.asarray(meta.layer_ids), kind="stable"))
        if int((self.lengths > pack_tokens).sum()):
            log.warning("%d samples longer than train.pack_tokens=%d are truncated",
                        int((self.lengths > pack_tokens).sum()), pack_tokens)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Batches -> rows -> sample indices, for one epoch."""
        order = np.random.default_rng(self.seed + epoch).permutation(self.table.num_rows)
        rows, cur, used = [], [], 0
        for i in order.tolist():
            n = min(int(self.lengths[i]), self.pack_tokens)
            if cur and used + n > self.pack_tokens:
                rows.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += n
        if cur:
            rows.append(cur)
        return [rows[j:j + self.batch_rows] for j in range(0, len(rows), self.batch_rows)]

    def _sample(self, i: int):
        m = self.meta
        t = int(self.lengths[i])
        n = min(t, self.pack_tokens)
        row = self.table.slice(i, 1).to_pylist()[0]
        ids = torch.tensor(row["input_ids"][:n], dtype=torch.long)
        mask = torch.tensor(row["loss_mask"][:n], dtype=torch.bool)
        aux = S.torch_from_blob(row["aux_hidden"], (t, len(m.layer_ids), m.hidden_size), m.dtype)
        aux = aux[:n, self.aux_order].float().reshape(n, -1)
        last = S.torch_from_blob(row["last_hidden"], (t, m.hidden_size), m.dtype)[:n].float()
        return ids, mask, aux, last

    def collate(self, rows: list[list[int]]) -> Batch:
        """Pack each row's samples, pad rows to the longest; padding has doc id -1."""
        built = []
        for row in rows:
            parts = [self._sample(i) for i in row]
            doc = torch.cat([torch.full((p[0].shape[0],), d, dtype=torch.long) for d, p in enumerate(parts)])
            pos = torch.cat([torch.arange(p[0].shape[0]) for p in parts])
            built.append((*(torch.cat([p[j] for p in parts]) for j in range(4)), doc, pos))
        width = max(b[0].shape[0] for b in built)

        def pad(x: torch.Tensor, fill) -> torch.Tensor:
            extra = width - x.shape[0]
            return torch.cat([x, x.new_full((extra, *x.shape[1:]), fill)]) if extra else x

        return Batch(
            input_ids=torch.stack([pad(b[0], 0) for b in built]),
            loss_mask=torch.stack([pad(b[1], False) for b in built]),
            aux=torch.stack([pad(b[2], 0.0) for b in built]),
            last_hidden=torch.stack([pad(b[3], 0.0) for b in built]),
            doc_ids=torch.stack([pad(b[4], -1) for b in built]),
            position_ids=torch.stack([pad(b[5], 0) for b in built]),
        )


def read_split(uri: str, *, version: int | str | None, split: str):
    """(table of COLUMNS for ``split``, FeatureMeta, resolved version number) at a pinned version."""
    from eaglenest.featurestore import store

    ds = store.dataset(uri, store.FEATURES, version)
    meta = S.feature_meta(ds.schema)
    quoted = split.replace("'", "''")
    table = ds.to_table(columns=COLUMNS, filter=f"split = '{quoted}' AND num_loss_tokens > 0")
    return table, meta, int(ds.version)
