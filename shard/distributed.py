"""The process group of one deployment: every rank of a tensor-parallel model talks through it.

gloo on CPU and NCCL on CUDA; with one rank, a no-op group so that model code never asks how many ranks
there are before it reduces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroup:
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's `tensor` along `dim`, in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def min(self, value: int) -> int:
        """The smallest `value` over ranks, so that ranks agree on a size each measured alone."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def initialize(device: torch.device) -> ProcessGroup:
    """Joins the group described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as the launcher sets them)."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT", "29500")
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
    return ProcessGroup(rank, world_size)
