"""``train.source=stream``: train on hidden states from a live capture engine instead of the table.

:class:`StreamShards` stands in for :class:`eaglenest.train.data.FeatureShards` in the trainer: the
same global plan (same eligible samples, same per-epoch shuffle and packing, so the same batches for
the same samples), but the sample list and lengths come from the ``prompts`` table and the tensors
from a :class:`eaglenest.featurestore.stream.local.CaptureStream`, started with the exact order in which
the trainer will read (``start(schedule)``). Decoded rows are those the table path gives (ids,
loss mask on the response, aux layers in ascending id order as fp32, last hidden as fp32) and go
through the same :func:`collate`.

The feature set is what ``featurestore capture`` would write with the recipe's ``featurestore``
section (layer ids, engine dtype): its :class:`FeatureMeta` and identity are computed the same way.
Sample order is by ``sample_id``, which is the table order of a capture made in one run.

With ``train.stream.transport=gloo`` (:mod:`eaglenest.featurestore.stream.xhost`) every torchrun
rank is fed its own share, the rows :func:`rank_rows` gives it, by ``train.stream.engines`` engines
started with ``featurestore stream-serve``; a rank left without rows in a last batch (a ghost: it
runs the step with no loss) gets the batch's first row with zero hidden states instead of having
it captured twice. With ``unix`` (the default) the engine is a child process and one rank is fed.

Trade-offs: the target runs again every epoch (nothing is stored). Resume works: the stream
starts at the resumed step.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore.capture import build, policy, turns
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.stream.group import is_local
from eaglenest.featurestore.stream.local import CaptureStream
from eaglenest.featurestore.stream.xhost import RankStream
from eaglenest.featurestore.table import store
from eaglenest.train.data import aux_order, collate, plan_batches, rank_rows
from eaglenest.train.dist import rank_env

log = logging.getLogger(__name__)


class StreamShards:
    """The table-less data source: a plan from ``prompts``, tensors from a live engine."""

    def __init__(self, store_uri: str, *, featurestore, target: str, split: str, pack_tokens: int,
                 batch_rows: int, seed: int, depth: int, row_tokens: int = 0, devices: str = "",
                 trust_remote_code: bool = False, transport: str = "unix", engines: int = 1, addr: str = "",
                 timeout_s: float = 1800.0):
        if featurestore is None:
            raise ConfigError("train.source=stream needs the recipe's featurestore section (engine, layer_ids)")
        if transport == "gloo" and rank_env().rank == 0:  # the rank that hosts the stream's store
            is_local(parse_addr(addr)[0], addr, "train.stream.addr")  # resolves: before the data and the target load
        if not store.exists(store_uri, store.PROMPTS):
            raise StoreError(f"no prompts table in {store_uri}: run `ingest build` first")
        ds = store.dataset(store_uri, store.PROMPTS)
        #: The prompts version the stream was planned from (pinned in provenance and state).
        self.version = int(ds.version)
        #: What provenance names as the run's input table.
        self.input_table = "prompts (streamed)"
        pool = ds.to_table(filter=f"split = {store.sql_text(split)} AND finish_reason != ''").to_pylist()
        pool = sorted(pool, key=lambda r: r["sample_id"])
        # The table's loss mask (build.feature_row): every answer of a multi-turn conversation. The rows
        # trained are the table path's: those with a token to learn (num_loss_tokens > 0), a conversation
        # whose last answer is empty included when an earlier answer is not.
        spans = build._turn_spans(target, pool, policy.rendered_kwargs(store_uri), trust_remote_code=trust_remote_code)
        masks = [np.asarray(turns.loss_mask(len(c["prompt_token_ids"]), len(c["response_token_ids"]),
                                            list(spans(c))), dtype=bool) for c in pool]
        keep = [i for i, m in enumerate(masks) if m.any()]
        self.convs, self.masks = [pool[i] for i in keep], [masks[i] for i in keep]
        if not self.convs:
            raise StoreError(f"prompts v{self.version}: no conversations to train on (check train.split={split!r})")
        self.meta = build.feature_meta(target, featurestore.layer_ids, featurestore.engine.dtype,
                                       storage="raw", sample_ids=[r["sample_id"] for r in pool],
                                       gen_params_ids=[r["gen_params_id"] for r in pool],
                                       trust_remote_code=trust_remote_code)
        self.trust_remote_code = trust_remote_code
        self.lengths = np.array([len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in self.convs],
                                dtype=np.int64)
        # What `featurestore capture` refuses before its engine starts, refused before this one starts.
        build.check_lengths(self.convs, featurestore.engine.max_model_len)
        self.vocab_size = build.target_facts(target, trust_remote_code=trust_remote_code)["vocab_size"]
        build.check_token_ids(self.convs, target, vocab_size=self.vocab_size, trust_remote_code=trust_remote_code)
        self.split, self.pack_tokens, self.batch_rows, self.seed = split, pack_tokens, batch_rows, seed
        self.row_tokens = row_tokens
        self.target, self.engine, self.depth, self.devices = target, featurestore.engine, depth, devices
        self.window = featurestore.batch_size
        self.transport, self.num_engines, self.addr, self.timeout_s = transport, engines, addr, timeout_s
        self.aux_order = aux_order(self.meta.layer_ids)
        self._stream = None

    @property
    def num_rows(self) -> int:
        return len(self.convs)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """Exactly the table path's plan (same algorithm, same inputs: lengths in sample-id order)."""
        return plan_batches(self.lengths, pack_tokens=self.pack_tokens, batch_rows=self.batch_rows,
                            seed=self.seed, epoch=epoch, row_tokens=self.row_tokens)

    def loss_token_counts(self, vocab_size: int) -> np.ndarray:
        """Per-target-id counts of loss tokens: what the table path counts by SQL. As there, every input
        token is checked against the vocab (the draft embeds each one): an id outside ``[0, vocab_size)``
        is one :class:`ConfigError` line naming the sample and the id (np.bincount failed on a negative
        one, and one past the vocab was dropped without a word)."""
        seqs = [np.asarray(r["prompt_token_ids"] + r["response_token_ids"], dtype=np.int64) for r in self.convs]
        for r, ids in zip(self.convs, seqs):
            if ids.size and not 0 <= ids.min() <= ids.max() < vocab_size:
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise ConfigError(f"prompts v{self.version}, sample '{r['sample_id']}': token id {bad} is outside "
                                  f"the target vocab [0, {vocab_size}): the conversation was tokenized for another "
                                  "target or tokenizer (the draft embeds every input token)")
        return np.bincount(np.concatenate([ids[m] for ids, m in zip(seqs, self.masks)]), minlength=vocab_size)

    def start(self, schedule: list[tuple[int, list[list[int]]]], *, world_size: int = 1,
              rank: int | None = None) -> None:
        """Start the stream of this rank's samples of ``schedule``, in the order :meth:`read` asks for them.

        ``rank`` defaults to torchrun's ``RANK``. With the unix transport the engine is started
        here (one rank only); with gloo this rank joins the engines started by ``stream-serve``."""
        rank = rank_env().rank if rank is None else rank
        if self.transport == "unix" and world_size != 1:
            raise ConfigError("train.source=stream with train.stream.transport=unix feeds one rank: run "
                              "`train run`, or set train.stream.transport=gloo for torchrun")
        self._reads, self._order, steps = [], [], []
        for step, (_, rows) in enumerate(schedule):
            mine, ghost = rank_rows(rows, rank, world_size)
            self._reads.append((mine, ghost))
            if not ghost:
                new = [i for row in mine for i in row]
                self._order += new
                steps += [step] * len(new)
        seqs = [self.convs[i]["prompt_token_ids"] + self.convs[i]["response_token_ids"] for i in self._order]
        self._pos, self._read = 0, 0
        if self.transport == "gloo":
            log.info("rank %d: %d samples from %d engines over gloo at %s (%d in flight at most)",
                     rank, len(seqs), self.num_engines, self.addr, self.depth)
            spec = {"target": str(self.target), "layer_ids": list(self.meta.layer_ids),
                    "num_layers": self.meta.last_layer_id, "hidden_size": self.meta.hidden_size,
                    # what stream-serve checks its model against besides the shape (stream.hostcheck)
                    "dtype": self.meta.dtype, "vocab_size": self.vocab_size,
                    "engine": dataclasses.asdict(self.engine),
                    "window": max(1, min(self.window or self.depth, self.depth)),
                    "trust_remote_code": self.trust_remote_code}
            self._stream = RankStream(self.addr, rank=rank, world_size=world_size, num_engines=self.num_engines,
                                      spec=spec, sequences=seqs, steps=steps, depth=self.depth,
                                      timeout_s=self.timeout_s)
            return
        if not seqs:  # e.g. a resumed run that is already finished: no engine to start
            return
        log.info("streaming %d samples from a live %s engine (%d in flight at most)",
                 len(seqs), self.target, self.depth)
        self._stream = CaptureStream(self.target, layer_ids=self.meta.layer_ids,
                                     num_layers=self.meta.last_layer_id, engine=self.engine, sequences=seqs,
                                     depth=self.depth, window=self.window,
                                     env={"CUDA_VISIBLE_DEVICES": self.devices} if self.devices else None,
                                     trust_remote_code=self.trust_remote_code)

    def read(self, rows: list[list[int]]):
        """The next batch of the stream, which must be ``rows`` (the schedule given to start)."""
        if self._read >= len(self._reads) or self._reads[self._read][0] != rows:
            raise StoreError(f"stream read out of schedule order at batch {self._read}")
        ghost = self._reads[self._read][1]
        self._read += 1
        if ghost:  # no loss on this rank: the row's ids and mask with zero hidden states, nothing captured
            return collate([[self._blank(i) for i in row] for row in rows])
        if self._stream is None:
            raise StoreError("StreamShards.read before start(schedule)")
        return collate([[self._decode(i) for i in row] for row in rows])

    def _blank(self, i: int):
        conv = self.convs[i]
        n = min(len(conv["prompt_token_ids"]) + len(conv["response_token_ids"]), self.pack_tokens)
        ids = torch.tensor((conv["prompt_token_ids"] + conv["response_token_ids"])[:n], dtype=torch.long)
        H, L = self.meta.hidden_size, len(self.meta.layer_ids)
        return ids, torch.from_numpy(self.masks[i][:n].copy()), torch.zeros(n, L * H), torch.zeros(n, H)

    def _decode(self, i: int):
        if self._pos >= len(self._order) or self._order[self._pos] != i:
            raise StoreError(f"stream read out of schedule order at position {self._pos}")
        self._pos += 1
        conv = self.convs[i]
        ids, hidden = self._stream.next()
        p, r = conv["prompt_token_ids"], conv["response_token_ids"]
        if ids.tolist() != list(p) + list(r):
            raise StoreError(f"capture stream: token ids of {conv['sample_id']} differ from the sequence sent")
        n = min(len(ids), self.pack_tokens)
        mask = torch.from_numpy(self.masks[i][:n].copy())
        aux = hidden[:n, :-1][:, self.aux_order].float().reshape(n, -1)
        last = hidden[:n, -1].float()
        return torch.from_numpy(ids[:n].copy()), mask, aux, last

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
