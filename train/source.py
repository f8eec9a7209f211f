"""The trainer's data source, chosen once from ``train.source``: the features table or a live stream.

The trainer asks a source for the same things whichever it is (:class:`DataSource`): the feature
set's meta and pinned version, the eligible samples' lengths, one epoch's global batch plan, the
loss-token counts that pick the draft vocabulary, and the batches of a schedule. Two implement it:

* ``table`` (:class:`eaglenest.train.data.FeatureShards`): a pinned version of the features table,
  on local disk or on an object store (``run.store``), read by row on demand, its batches in the
  stored dtype (bf16 for a bf16 table: read straight into the batch, converted on the device by
  the step, which casts them anyway; fp8 tables are dequantised to fp32 on the reader's threads);
* ``stream`` (:class:`eaglenest.train.stream_source.StreamShards`): no table; the plan comes from
  the ``prompts`` table and the hidden states from a capture engine (``train.stream``), which must
  know the reading order before the first batch (:meth:`DataSource.start`).

Trade-off: the protocol is what the trainer needs and nothing more, so a third source (another
transport, a remote reader) is one class here and no branch in :mod:`eaglenest.train.loop`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from eaglenest.featurestore.schema import FeatureMeta
from eaglenest.train.config import TrainConfig
from eaglenest.train.data import FeatureShards
from eaglenest.train.stream_source import StreamShards
from eaglenest.train.ttt import Batch

#: One global batch of the schedule: (epoch, rows of eligible-sample indices).
Scheduled = tuple[int, list[list[int]]]


class DataSource(Protocol):
    #: The feature set: layer ids, hidden size, identity.
    meta: FeatureMeta
    #: The pinned table version read (features; prompts for the stream), in provenance and state.
    version: int
    #: Tokens of each eligible sample, in plan order.
    lengths: np.ndarray
    #: What provenance names as the run's input table.
    input_table: str

    @property
    def num_rows(self) -> int: ...

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Global batches -> rows -> sample indices for ``epoch`` (the same on every rank)."""

    def loss_token_counts(self, vocab_size: int) -> np.ndarray:
        """int64 [vocab_size]: loss tokens per target id (the draft vocabulary's counts)."""

    def start(self, schedule: list[Scheduled], *, world_size: int = 1) -> None:
        """The batches this run will read, in order, before the first :meth:`read`."""

    def read(self, rows: list[list[int]]) -> Batch:
        """This rank's rows of a global batch, packed and padded."""

    def close(self) -> None:
        """Release what the source holds (the version pin and reader; the engine)."""


def open_source(cfg: TrainConfig, store_uri: str, *, table: str, seed: int, target_dir: str, featurestore,
                trust_remote_code: bool = False) -> DataSource:
    """The data source ``cfg.source`` names. ``table``: the feature set (``featurestore.table``);
    ``featurestore``: the recipe's FeaturestoreConfig, whose engine and layer ids the stream captures with."""
    if cfg.source == "stream":
        s = cfg.stream
        return StreamShards(store_uri, featurestore=featurestore, target=target_dir, split=cfg.split,
                            pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=seed, depth=s.depth,
                            row_tokens=cfg.row_tokens,
                            devices=s.devices, transport=s.transport, engines=s.engines, addr=s.addr,
                            timeout_s=s.timeout_s, trust_remote_code=trust_remote_code)
    return FeatureShards(store_uri, version=cfg.table_version, split=cfg.split, table=table,
                         pack_tokens=cfg.pack_tokens, batch_rows=cfg.batch_rows, seed=seed, batch_dtype="stored",
                         row_tokens=cfg.row_tokens)
