"""The process group of one deployment: every rank of a tensor-parallel model talks through it.

gloo on CPU and NCCL on CUDA; with one rank, a no-op group so that model code never asks how many ranks
there are before it reduces.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from conveyor.group_store import GroupStore

log = logging.getLogger(__name__)
T = TypeVar("T")
# A rank whose group broke (a peer died or restarted) exits with this code: the group cannot heal, and its
# launcher restarts it whole (on several nodes, by moving the group's epoch on: conveyor/group_store.py).
GROUP_LOST_EXIT_CODE = 75


def _collective(run: Callable[[], T]) -> T:
    try:
        return run()
    except RuntimeError as exc:  # gloo's "Connection closed by peer" and the like
        log.critical("lost the process group; exiting", extra={"error": str(exc)})
        os._exit(GROUP_LOST_EXIT_CODE)


@dataclass(frozen=True)
class ProcessGroup:
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over ranks, in place."""
        if self.world_size > 1:
            _collective(lambda: dist.all_reduce(tensor))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates every rank's `tensor` along `dim`, in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        _collective(lambda: dist.all_gather(parts, tensor.contiguous()))
        return torch.cat(parts, dim=dim)

    def min(self, value: int) -> int:
        """The smallest `value` over ranks, so that ranks agree on a size each measured alone."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        _collective(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN))
        return int(tensor.item())

    def gather(self, value: str) -> list[str]:
        """Every rank's `value`, in rank order: how rank 0 learns the other ranks' addresses."""
        if self.world_size == 1:
            return [value]
        values: list[str | None] = [None] * self.world_size
        _collective(lambda: dist.all_gather_object(values, value))
        return [str(v) for v in values]


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def initialize(device: torch.device, timeout: float) -> ProcessGroup:
    """Joins the group described by RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as the launcher sets them),
    waiting up to `timeout` seconds for the other ranks. On one node, rank 0 hosts the rendezvous; across nodes
    (CONVEYOR_GROUP_EPOCH set), node 0's launcher does, and this epoch's ranks meet under its own prefix;
    `timeout` is how long they wait for one another there."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        address = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and (lo := loopback_interface(address)):
            os.environ["GLOO_SOCKET_IFNAME"] = lo
        if (epoch := os.environ.get("CONVEYOR_GROUP_EPOCH")) is None:
            dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        else:
            store = GroupStore(address, port, host_it=False, timeout=timeout).rendezvous(int(epoch))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return ProcessGroup(rank, world_size)


def loopback_interface(master_address: str) -> str | None:
    """The loopback interface (lo), for gloo's connections between ranks that meet at a loopback address: they all
    run on this machine. Left to itself, gloo binds whatever this machine's hostname resolves to: a name server is
    asked where /etc/hosts does not name it, and ranks talk over the LAN address (ports open to the network)
    where it does; tests and benchmarks send traffic to loopback only. None where ranks meet elsewhere (several
    machines) or no loopback interface is found; GLOO_SOCKET_IFNAME, when set, is left as it is."""
    try:
        on_loopback = ipaddress.ip_address(master_address).is_loopback
    except ValueError:
        on_loopback = master_address == "localhost"
    names = {name for _, name in socket.if_nameindex()} if on_loopback else set()
    return next((name for name in ("lo", "lo0") if name in names), None)
