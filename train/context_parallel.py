"""Context parallelism (``train.context_parallel``): each packed row's tokens split over a group of ranks.

What grows with the row length T is the draft's activations (fc input 3*H per token, the layer's
2*H qkv input, the MLP, the draft-vocab logits of every TTT step): linear in T with the chunked
attention, but one rank's memory caps T. Split over C ranks, each holds ~T/C positions of them.

How a row is split (:func:`split_batch`): padded to a multiple of C, rank r owns the contiguous
positions ``[r*n, (r+1)*n)``, n = ceil(T/C), plus a read-only halo of K+1 positions after them:
TTT step k of chain t reads the token x_{t+1+k}, the target distribution at t+1+k and the loss
mask and document of t+2+k (:mod:`eaglenest.train.ttt`), so the last chains of a part look up to
K+1 positions into the next part. Only the halo's small inputs are read; no query runs there.

Attention: the step-0 keys and values are all-gathered once per row (:class:`Gather`; step 0
computes them, steps 1..K reuse them from the cache), so every local query sees the whole causal
prefix, and the masks are built at global positions (doc, causal and sliding window, via
:func:`eaglenest.train.model.chunk_doc_mask`). The TTT steps' extra keys ("diagonal" entries) are
chain t's own keys at its own position t: they never leave the rank that owns t. Gather's backward
sums the gathered K/V gradient over the group and keeps the owner's slice (a reduce-scatter, done as
all-reduce + slice because gloo has no reduce-scatter), so the ranks' gradients sum to the one-rank
gradient; with FSDP2 over all ranks that sum is what the trainer's ``loss * world_size`` gets.

Trade-off: contiguous parts instead of a load-balanced zig-zag split. With causal attention the
last part's queries attend over more keys than the first's (of 2 ranks, rank 0 computes 1/4 of the
causal score matrix, rank 1 3/4), but the rest of the draft's per-token work (fc, MLP, lm_head, loss; most
of a one-layer draft's FLOPs at the lengths measured in bench/train_long.py) is balanced, the
chunked path keeps skipping keys after each chunk, and the TTT halo is one boundary, not 2C. Keys
and values are all-gathered rather than passed round a ring: the draft has one layer, so the
gathered K/V (2 x kv_heads x head_dim per token) are small next to the per-token activations.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from eaglenest.errors import ConfigError
from eaglenest.train.ttt import Batch, ChunkedSoftCE, TTTObjective, TTTResult, step_valid

log = logging.getLogger(__name__)

#: Fill values of padding per Batch field (doc id -1: no loss, sees nothing but padding).
PAD = {"input_ids": 0, "loss_mask": False, "doc_ids": -1, "position_ids": 0, "aux": 0.0, "last_hidden": 0.0}


class Gather(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (equal parts, rank order); backward: the group's sum
    of the gradient, this rank's slice (every rank's loss depends on every rank's keys)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        n = total.shape[ctx.dim] // dist.get_world_size(ctx.group)
        return total.narrow(ctx.dim, dist.get_rank(ctx.group) * n, n), None, None


@dataclasses.dataclass
class SeqShard:
    """This rank's part of the rows: what the draft's attention needs (see DraftAttention.forward)."""

    #: Global position of the first owned token; owned tokens per row; the group's padded row [B, C*n].
    start: int
    num_tokens: int
    doc_ids: torch.Tensor
    #: The context-parallel process group (None: single process, tests of the split only).
    group: object = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, n, d] of each rank -> [B, heads, C*n, d] of the whole row."""
        return Gather.apply(x, self.group, 2)


@dataclasses.dataclass
class ShardBatch(Batch):
    """A Batch of this rank's positions plus the halo (``num_tokens + halo`` per row), and its shard."""

    shard: SeqShard


def split_batch(batch: Batch, *, rank: int, size: int, halo: int, group=None) -> ShardBatch:
    """Rank ``rank`` of ``size``'s contiguous part of every row, then ``halo`` positions after it
    (padding past the row's end). Pure: the same rows give every rank the same split."""
    t = batch.input_ids.shape[1]
    n = math.ceil(t / size)
    width = n * size + halo
    fields = {}
    for f in dataclasses.fields(Batch):
        x = getattr(batch, f.name)
        if width > t:
            x = torch.cat([x, x.new_full((x.shape[0], width - t, *x.shape[2:]), PAD[f.name])], dim=1)
        fields[f.name] = x
    start = rank * n
    local = {k: v[:, start:start + n + halo] for k, v in fields.items()}
    shard = SeqShard(start=start, num_tokens=n, doc_ids=fields["doc_ids"][:, :n * size], group=group)
    return ShardBatch(**local, shard=shard)


def owned_valid(batch: ShardBatch, k: int) -> torch.Tensor:
    """bool [B, n]: ttt.step_valid at this rank's own positions (the halo supplies t+2+k)."""
    return step_valid(batch, k)[:, :batch.shard.num_tokens]


def real_tokens(batch: Batch) -> int:
    """Non-padding tokens this rank trains on (a ShardBatch: its own positions, not the halo)."""
    doc = batch.doc_ids[:, :batch.shard.num_tokens] if isinstance(batch, ShardBatch) else batch.doc_ids
    return int((doc >= 0).sum())


def cp_ttt_loss(model, batch: ShardBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
    """:func:`eaglenest.train.ttt.ttt_loss` over this rank's positions of a split row.

    ``target_probs`` / ``target_argmax``: of the batch's positions, halo included. With the
    global ``denominators`` the ranks' losses sum to the one-rank loss of the whole rows.
    """
    n = batch.shard.num_tokens
    assert batch.input_ids.shape[1] >= n + num_steps + 1, "the halo must cover ttt_steps + 1 positions"
    chunked = bool(chunk_tokens) and batch.input_ids.shape[0] * n > chunk_tokens
    hidden = model.combine(batch.aux[:, :n].to(model.fc.weight.dtype))
    cache: list = []
    loss = hidden.new_zeros(())
    step_loss, step_correct, step_count = [], [], []
    for k in range(num_steps):
        tokens = batch.input_ids[:, 1 + k:1 + k + n]  # x_{t+1+k}: the halo holds the last ones
        normed, next_hidden = model.step(tokens, hidden, batch.position_ids[:, :n] + k, cache, batch.shard)
        valid = owned_valid(batch, k)
        count = int(valid.sum())
        denom = denominators[k] if denominators is not None else count
        probs = target_probs[:, 1 + k:1 + k + n]  # a view: the distribution at t+1+k
        if chunked:
            ce_sum, draft_pred = ChunkedSoftCE.apply(model.logits(normed), probs, valid, 0, int(chunk_tokens))
            lk = ce_sum / max(denom, 1)
        else:
            logp = torch.log_softmax(model.logits(normed).float(), dim=-1)
            lk = (-(probs * logp).sum(-1) * valid).sum() / max(denom, 1)
            draft_pred = logp.argmax(-1)
        loss = loss + (step_decay ** k) * lk
        with torch.no_grad():
            correct = (model.draft_to_target(draft_pred) == target_argmax[:, 1 + k:1 + k + n]) & valid
        step_loss.append(float(lk.detach()))
        step_correct.append(int(correct.sum()))
        step_count.append(count)
        hidden = next_hidden
    return TTTResult(loss=loss, step_loss=step_loss, step_correct=step_correct, step_count=step_count)


class CPObjective(TTTObjective):
    """The EAGLE-3 TTT objective on ShardBatches (FSDP2's root, like TTTObjective)."""

    def counts(self, batch: ShardBatch, num_steps: int) -> list[int]:
        return [int(owned_valid(batch, k).sum()) for k in range(num_steps)]

    def forward(self, batch: ShardBatch, target_probs: torch.Tensor, target_argmax: torch.Tensor, *,
                num_steps: int, step_decay: float, denominators: list[float] | None = None,
                chunk_tokens: int = 0) -> TTTResult:
        return cp_ttt_loss(self.draft, batch, target_probs, target_argmax, num_steps=num_steps,
                           step_decay=step_decay, denominators=denominators, chunk_tokens=chunk_tokens)


@dataclasses.dataclass
class ContextParallel:
    """The (dp, cp) DeviceMesh of a run with ``train.context_parallel`` = C > 1: consecutive ranks
    in groups of C share rows (the cp dimension), the world_size / C groups split each global batch's
    rows (the dp dimension). FSDP2 still shards over all ranks (the trainer's 1-D mesh)."""

    size: int
    rank: int
    dp_rank: int
    dp_size: int
    group: object
    mesh: object

    @classmethod
    def create(cls, size: int, dist) -> "ContextParallel | None":
        """None for ``size`` 1; refuses a world size that ``size`` does not divide (a DistState)."""
        if size == 1:
            return None
        if not dist.distributed or dist.world_size % size:
            raise ConfigError(f"train.context_parallel={size}: needs a multiple of {size} ranks (train launch "
                              f"--nproc), this run has {dist.world_size}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dist.device.type, (dist.world_size // size, size), mesh_dim_names=("dp", "cp"))
        if dist.is_main:
            log.info("context parallelism: each row split over %d ranks, %d data-parallel groups",
                     size, dist.world_size // size)
        return cls(size=size, rank=mesh.get_local_rank("cp"), dp_rank=mesh.get_local_rank("dp"),
                   dp_size=dist.world_size // size, group=mesh.get_group("cp"), mesh=mesh)

    def split(self, batch: Batch, *, halo: int) -> ShardBatch:
        return split_batch(batch, rank=self.rank, size=self.size, halo=halo, group=self.group)
