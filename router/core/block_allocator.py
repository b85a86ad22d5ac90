"""The KV budget of a paged deployment, in blocks: the router decides where every request's KV lives.

Owning the blocks here (not in the shards) lets admission count real memory and lets every rank write the same
slots without talking to each other. Blocks are handed out one at a time as sequences grow, so a request holds
only what it has filled (plus its current block), not its worst case. Full blocks whose KV is computed can be
registered in a prefix cache (`prefix_cache.py`) and shared by later requests with the same prefix; when a
request leaves, its cached blocks stay as they are until memory runs short, then the least recently used are
reclaimed. Free and cached-but-unused blocks together are the memory admission may count on.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from conveyor.router.core.prefix_cache import PrefixCache


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    free_list: int  # never used, or given back private
    cached: int  # registered in the prefix cache, read or not
    evictable: int  # cached and read by nobody: allocate() may reclaim them
    queried_blocks: int  # full blocks match() was asked for, since start
    hit_blocks: int  # of those, found in the cache
    evictions: int  # cached blocks reclaimed for allocate(), since start


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block allocator needs at least one block of at least one token")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._queried = self._hits = self._evictions = 0
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Every block free and the prefix cache empty: after the shards restarted, their KV is gone, and the
        new pool may be of another size."""
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a min-heap (sorted already): low ids go out first
        self._free_set: set[int] = set(self._free)  # for catching double frees in O(1)
        self._cache = PrefixCache(self.block_size)

    @property
    def free_blocks(self) -> int:
        """What allocate() could hand out now: an unread cached block is as good as free, it is just kept warm."""
        return len(self._free) + self._cache.unreferenced

    @property
    def cached_blocks(self) -> int:
        return len(self._cache)

    @property
    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks,
            free_list=len(self._free),
            cached=len(self._cache),
            evictable=self._cache.unreferenced,
            queried_blocks=self._queried,
            hit_blocks=self._hits,
            evictions=self._evictions,
        )

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def is_free(self, block: int) -> bool:
        """Whether allocate() may hand this block out: on the free list, or cached and read by nobody."""
        return block in self._free_set or self._cache.refcount(block) == 0

    def refcount(self, block: int) -> int | None:
        """Readers of a cached block; None for a block the cache does not hold."""
        return self._cache.refcount(block)

    def allocate(self, count: int) -> list[int] | None:
        """`count` private blocks, or None and nothing taken: a half-grown request is worse than a refusal."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.free_blocks:
            return None
        return [self._take() for _ in range(count)]

    def match(self, tokens: Sequence[int], max_blocks: int | None = None, scope: Hashable = "") -> list[int]:
        """Holds and returns the blocks of the longest prefix of `tokens` cached in `scope` (see PrefixCache);
        give them back with release().

        Only full blocks can match: a partial block is still being written by whoever owns it.
        """
        if not self.prefix_caching:
            return []
        limit = len(tokens) // self.block_size
        if max_blocks is not None:
            limit = max(min(limit, max_blocks), 0)
        blocks = self._cache.match(tokens, limit, scope)
        self._queried += limit
        self._hits += len(blocks)
        return blocks

    def cached_prefix(self, tokens: Sequence[int], scope: Hashable = "") -> int:
        """How many full blocks of `tokens` this pool has cached in `scope`, holding none and counting no query: a
        placement's question before the request joins any group."""
        if not self.prefix_caching:
            return 0
        return self._cache.peek(tokens, len(tokens) // self.block_size, scope)

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], scope: Hashable = "") -> int:
        """Registers the computed full blocks of a sequence in `scope`; returns how many leading blocks are now
        cached there.

        Stops at the first block whose content is cached in another block (computed concurrently) or whose
        hash collides: that block and the ones after it stay private, so a cached node is never the child of
        a block its readers do not also hold. Safe to call again as the sequence grows.
        """
        if not self.prefix_caching:
            return 0
        count = min(len(tokens) // self.block_size, len(blocks))
        for block in blocks[:count]:
            if block in self._free_set:
                raise ValueError(f"block {block} is free: insert only blocks you hold")
        return self._cache.insert(tokens, blocks, scope)

    def release(self, blocks: Sequence[int]) -> None:
        """Drops the caller's hold on each block: cached ones stay cached, private ones go back to the free list.

        Everything is checked before anything changes, so a double release raises and leaves the pool intact.
        """
        cached = [b for b in blocks if b in self._cache]
        private = [b for b in blocks if b not in self._cache]
        self._check_private(private)
        self._cache.release(cached)
        for block in private:
            heapq.heappush(self._free, block)
            self._free_set.add(block)

    def _check_private(self, blocks: list[int]) -> None:
        for block, times in Counter(blocks).items():
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} does not exist (the pool has {self.num_blocks})")
            if times > 1 or block in self._free_set:
                raise RuntimeError(f"block {block} freed twice: it is already free")

    def _take(self) -> int:
        if self._free:
            block = heapq.heappop(self._free)
            self._free_set.remove(block)
            return block
        block = self._cache.evict()
        if block is None:
            raise RuntimeError("the prefix cache counted an evictable block it could not evict")
        self._evictions += 1
        return block
