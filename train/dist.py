"""Distributed state for the trainer: one explicit object holding the process group's DeviceMesh.

``DistState.from_env()`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``; checked once for every reader by :func:`rank_env`). Without it the trainer is a
plain single process: no process group, no FSDP, and every helper here still works (``all_reduce_sum``
is the identity, ``barrier`` a no-op), so rank-0 code paths need no special cases. Under torchrun (any
world size, 1 included) the draft is wrapped with FSDP2: ``fully_shard`` on the block (``midlayer``),
then on the root, with a bf16 mixed-precision policy on CUDA when ``train.param_dtype`` asks for it
(CPU/gloo stays fp32).

Across nodes (``train launch --nnodes M``) the global rank says which rows a rank trains on and who
writes (rank 0); ``LOCAL_RANK`` only picks the GPU. c10d assigns global ranks at rendezvous, so
rank 0 may live on any node, and every rank writes its DCP shard into the run's state directory:
``run.workdir`` must be one shared filesystem (checked at start: :meth:`DistState.check_shared_dir`).

Trade-off: the draft has one block, so FSDP2 shards little here; it is used for the same code
path as a large draft, and so the state handling (DCP, full state dicts) is the distributed one.
torch.distributed is imported lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from eaglenest.errors import ConfigError

log = logging.getLogger(__name__)


def check_local_gpu(local_rank: int, num_gpus: int) -> None:
    """A rank whose LOCAL_RANK names no visible GPU (``--nproc-per-node`` above the node's GPUs):
    one line, not CUDA's "invalid device ordinal" traceback from each rank past the last GPU."""
    if not 0 <= local_rank < num_gpus:
        raise ConfigError(f"LOCAL_RANK {local_rank}: this node has {num_gpus} visible GPU(s), so at most "
                          f"--nproc-per-node {num_gpus} (one rank per GPU; CUDA_VISIBLE_DEVICES picks them)")


#: torchrun's variables, each an integer of at least this when set.
_TORCHRUN_VARS = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}


def _env_int(name: str) -> int | None:
    """torchrun's variable ``name`` as an int (None when unset): one line naming it for a value that is not a
    whole number of at least :data:`_TORCHRUN_VARS`'s bound (``WORLD_SIZE=""``, ``RANK=x``, ``LOCAL_RANK=-1``)."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    low = _TORCHRUN_VARS[name]
    if value is None or value < low:
        raise ConfigError(f"{name}={text!r} in the environment: torchrun's {name} must be an integer >= {low} "
                          "(unset RANK and WORLD_SIZE to train in one process)")
    return value


@dataclasses.dataclass(frozen=True)
class RankEnv:
    """torchrun's environment, checked: this process's global rank, the world size, and its node's."""

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    local_world_size: int | None = None


def rank_env() -> RankEnv:
    """torchrun's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``, read the same way by every
    reader (the trainer, ``train run``'s rank-0 duties and memory estimate, the streaming source): rank 0 and
    world 1 where unset. A value that cannot be torchrun's (not an integer, a rank past the world) is one
    :class:`ConfigError` naming the variable, not a bare ``int()`` error or a process group that waits for
    ranks that never come. ``DistState.from_env`` joins a process group only when both ``RANK`` and
    ``WORLD_SIZE`` are set; the local variables are read only then (``LOCAL_RANK=-1`` is how other launchers
    say "not distributed")."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None:
        return RankEnv(rank=rank or 0, world_size=world or 1)
    if rank >= world:
        raise ConfigError(f"RANK={rank} in the environment is not below WORLD_SIZE={world} (torchrun's ranks "
                          f"are 0..{world - 1})")
    local, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    if local_world is not None and local_world > world:
        raise ConfigError(f"LOCAL_WORLD_SIZE={local_world} in the environment is more than WORLD_SIZE={world}")
    if local is not None and local >= (local_world or world):
        raise ConfigError(f"LOCAL_RANK={local} in the environment is not below "
                          + (f"LOCAL_WORLD_SIZE={local_world}" if local_world is not None else f"WORLD_SIZE={world}"))
    return RankEnv(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


#: The last barrier's work, held until the interpreter tears this module down. gloo completes a work on
#: its worker thread, and the worker drops it afterwards, when it next runs: on a busy machine, after
#: this process has begun to exit. A barrier holds the works still in flight when it started (weakly,
#: which keeps them unfreed), among them FSDP2's all-gathers of the final state, whose tensors' Python
#: objects the main thread already released: the worker freeing them takes the GIL, and in an
#: interpreter that is finalizing that ends the thread (pthread_exit) inside a C++ destructor, so the
#: rank died with "terminate called without an active exception" (SIGABRT) after a finished run.
#: Held here, the barrier (and what it holds) is freed by the main thread when the module is torn down,
#: where torch no longer takes the GIL (``Py_IsInitialized()`` is false; it leaks the object). Closing the
#: group cannot stop the workers: gloo's backend has no ``shutdown``, and the DeviceMesh that FSDP2's
#: parameters and DTensor's caches hold keeps the group alive until the process ends.
_last_barrier: list[Any] = []


@dataclasses.dataclass
class DistState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: Ranks on this node (torchrun's LOCAL_WORLD_SIZE); world_size // local_world_size nodes.
    local_world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: The 1-D DeviceMesh over all ranks (None for a plain process).
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @classmethod
    def from_env(cls) -> "DistState":
        """Join torchrun's process group if its environment is set, else a plain single process."""
        env = rank_env()
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return cls()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        rank, world = env.rank, env.world_size
        # The GPU of this rank on its node (a launcher without LOCAL_RANK: ranks filled node by node).
        local = env.local_rank if env.local_rank is not None else rank % max(1, torch.cuda.device_count())
        if torch.cuda.is_available():
            check_local_gpu(local, torch.cuda.device_count())
            torch.cuda.set_device(local)
            device, backend, kind = torch.device("cuda", local), "nccl", "cuda"
        else:
            device, backend, kind = torch.device("cpu"), "gloo", "cpu"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
        log.info("rank %d/%d joined a %s process group", rank, world, backend)
        return cls(rank=rank, world_size=world, local_rank=local, device=device, mesh=mesh,
                   local_world_size=env.local_world_size or world)

    def check_shared_dir(self, path: Path) -> None:
        """Refuse a ``path`` that not every rank sees as rank 0 does (a collective).

        Rank 0 writes a probe file with a fresh name (so no node has a cached negative lookup of it);
        every rank must read it back. Without this, a workdir local to each node fails late: each
        rank's DCP shard lands on its own node's disk, and the state rank 0 renames and later resumes
        from lacks the other nodes' shards.
        """
        if not self.distributed:
            return
        token = self.broadcast_object(secrets.token_hex(8) if self.is_main else None)
        probe = Path(path) / f".shared-probe-{token}"
        if self.is_main:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text(token, encoding="utf-8")
        self.barrier()
        try:
            seen = probe.read_text(encoding="utf-8") == token
        except OSError:
            seen = False
        blind = int(self.all_reduce_sum([0.0 if seen else 1.0])[0])
        if self.is_main:
            probe.unlink(missing_ok=True)
        if blind:
            raise ConfigError(f"{path} is not shared by all nodes: {blind} of {self.world_size} ranks do not "
                              "see rank 0's files there; run.workdir must be one filesystem on every node "
                              "(NFS, a cluster filesystem), see docs/training.md, \"Multi-node\"")

    def shard(self, model: torch.nn.Module, *, param_dtype: str) -> torch.nn.Module:
        """FSDP2: ``fully_shard`` each block, then the root. Identity without a process group."""
        if not self.distributed:
            return model
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {"mesh": self.mesh}
        if self.device.type == "cuda" and param_dtype != "float32":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype),
                                                   reduce_dtype=torch.float32)
        for block in model.blocks():
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        return model

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a list of numbers over ranks (float64 on the wire; identity for one process)."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu().tolist()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (small JSON-like values only)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank. On gloo the barrier's work is kept until the interpreter tears this module
        down (:data:`_last_barrier`); NCCL's barrier is left as it was (it blocks the CPU only without
        ``async_op``)."""
        if not self.distributed:
            return
        import torch.distributed as dist

        if self.device.type == "cuda":
            dist.barrier()
            return
        work = dist.barrier(async_op=True)
        work.wait()
        _last_barrier[:] = [work]

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.mesh = None
