"""The epoch of a shard group that spans several nodes, kept in torch.distributed's own key-value store.

A tensor-parallel group cannot lose one rank, so when any rank of any node dies (or the router finds the group
hung), every node must restart its ranks, and they must meet again in a fresh rendezvous: a rank that joined the
old one would read its stale keys. Node 0's launcher hosts a `TCPStore` on --master-port for the deployment's
lifetime; it holds one counter, the epoch. Each group rendezvouses under the prefix of its epoch. Whoever sees
the group fail moves the epoch on once (compare-and-set, so two nodes noticing the same failure restart it once),
and every node's launcher, seeing the epoch move, restarts its ranks into the new one. This is torchrun's
elastic rendezvous cut down to what one fixed-size group needs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

KEY = "conveyor/epoch"


def prefix(epoch: int) -> str:
    """The key prefix of one epoch's rendezvous."""
    return f"conveyor/epoch-{epoch}/"


class GroupStore:
    def __init__(self, host: str, port: int, host_it: bool, timeout: float) -> None:
        """`host_it` on node 0's launcher, which serves the store; every other process is a client of it. torch is
        imported here, not with the module: the router imports this module and otherwise needs no torch."""
        import torch.distributed as dist

        self.store = dist.TCPStore(
            host, port, is_master=host_it, wait_for_workers=False, timeout=timedelta(seconds=timeout)
        )

    @property
    def epoch(self) -> int:
        return self.store.add(KEY, 0)

    def restart(self, failed: int | None = None) -> int:
        """Moves the epoch on from `failed` (default: the current one), unless someone already did; returns the
        epoch the group restarts in."""
        current = self.epoch  # also creates the counter, which compare_set needs
        failed = current if failed is None else failed
        self.store.compare_set(KEY, str(failed), str(failed + 1))
        return self.epoch

    def rendezvous(self, epoch: int) -> dist.Store:
        """The store a rank of `epoch` joins its group through."""
        import torch.distributed as dist

        return dist.PrefixStore(prefix(epoch), self.store)
