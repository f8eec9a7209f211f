"""Distributed state for the trainer: one explicit object holding the process group's DeviceMesh.

``DistState.from_env()`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
Without it the trainer is a plain single process: no process group, no FSDP, and every helper
here still works (``all_reduce_sum`` is the identity, ``barrier`` a no-op), so rank-0 code paths
need no special cases. Under torchrun (any world size, 1 included) the draft is wrapped with
FSDP2: ``fully_shard`` on the block (``midlayer``), then on the root, with a bf16 mixed-precision
policy on CUDA when ``train.param_dtype`` asks for it (CPU/gloo stays fp32).

Trade-off: the draft has one block, so FSDP2 shards little here; it is used for the same code
path as a large draft, and so the state handling (DCP, full state dicts) is the distributed one.
torch.distributed is imported lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DistState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: The 1-D DeviceMesh over all ranks (None for a plain process).
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @classmethod
    def from_env(cls) -> "DistState":
        """Join torchrun's process group if its environment is set, else a plain single process."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return cls()
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            device, backend, kind = torch.device("cuda", local), "nccl", "cuda"
        else:
            device, backend, kind = torch.device("cpu"), "gloo", "cpu"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        mesh = init_device_mesh(kind, (world,), mesh_dim_names=("dp",))
        log.info("rank %d/%d joined a %s process group", rank, world, backend)
        return cls(rank=rank, world_size=world, local_rank=local, device=device, mesh=mesh)

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
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.mesh = None
