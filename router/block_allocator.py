"""The KV budget of a paged deployment, in blocks: the router decides where every request's KV lives.

Owning the blocks here (not in the shards) lets admission count real memory, lets every rank write the same
slots without talking to each other, and is what a prefix cache will later share between requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    blocks: tuple[int, ...]
    slots: tuple[int, ...]  # one per token the request may write, in position order


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block allocator needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def allocate(self, tokens: int) -> Allocation | None:
        """Blocks for `tokens` KV slots, or None (and nothing taken) when too few are free."""
        count = self.blocks_for(tokens)
        if count > len(self._free):
            return None
        blocks = tuple(self._free.pop() for _ in range(count))
        bs = self.block_size
        slots = tuple(blocks[p // bs] * bs + p % bs for p in range(tokens))
        return Allocation(blocks, slots)

    def free(self, allocation: Allocation) -> None:
        self._free.extend(reversed(allocation.blocks))
        if len(self._free) > self.num_blocks:
            raise RuntimeError("more blocks were freed than exist: an allocation was freed twice")
