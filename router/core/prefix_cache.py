"""A radix tree of computed KV blocks keyed by their tokens, so requests sharing a prompt prefix share its blocks.

Every edge is one full block of tokens. A node's key chains its parent's key with its own tokens, because a
block's KV depends on every token before it, not only on its own: equal tokens after different prefixes must
never alias. The key is only a shortcut to the child; each node keeps its tokens and a hit is confirmed
against them, so a hash collision costs a miss, never another request's KV.

Each scope (whose blocks may be shared: an API key, or a salt, under an adapter; the router's `CacheScope`, any
hashable value here) has a tree of its own, so that a request never reuses, nor learns by its speed that there is,
KV computed for another scope's prompt. A scope's root goes once its last block is evicted.

Reference counts are the live requests reading a block. A request that holds a block holds all its ancestors,
so a parent has at least as many readers as any child, and the unreferenced nodes form whole subtrees: evicting
unreferenced leaves one at a time, least recently used first, reclaims all of them in the end.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

ROOT_KEY = 0


def block_hash(parent_key: int, tokens: tuple[int, ...]) -> int:
    """Python's tuple hash is deterministic within a process, which is all a cache living in one router needs.

    Looked up through the module on every call, so a test can swap it for a colliding one.
    """
    return hash((parent_key, tokens))


@dataclass(eq=False)
class Node:
    block: int
    tokens: tuple[int, ...]
    key: int
    parent: Node | None
    depth: int
    refcount: int = 0
    last_used: int = 0
    children: dict[int, Node] = field(default_factory=dict)


# (last_used, -depth, push order, node): oldest first, deepest first among equals; push order keeps nodes uncompared.
HeapEntry = tuple[int, int, int, Node]


class PrefixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[Hashable, Node] = {}  # by scope
        self._nodes: dict[int, Node] = {}  # by block id
        self._unreferenced = 0
        self._clock = 0  # a counter, not time: LRU order stays exact and tests stay deterministic
        self._heap: list[HeapEntry] = []  # evictable leaves, with stale entries skipped when popped
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block: int) -> bool:
        return block in self._nodes

    @property
    def unreferenced(self) -> int:
        """Cached blocks nobody reads: all of them can be evicted, leaves first."""
        return self._unreferenced

    def refcount(self, block: int) -> int | None:
        node = self._nodes.get(block)
        return None if node is None else node.refcount

    def _root(self, scope: Hashable, create: bool = False) -> Node | None:
        root = self._roots.get(scope)
        if root is None and create:
            root = self._roots[scope] = Node(block=-1, tokens=(scope,), key=ROOT_KEY, parent=None, depth=0)
        return root

    def match(self, tokens: Sequence[int], max_blocks: int, scope: Hashable = "") -> list[int]:
        """Acquires the longest chain of the first `max_blocks` full blocks of `tokens` cached in `scope`."""
        if self._root(scope) is None:
            return []
        found = self._chain(tokens, max_blocks, scope)
        now = self._tick()
        for node in found:
            if node.refcount == 0:
                self._unreferenced -= 1
            node.refcount += 1
            node.last_used = now
        return [n.block for n in found]

    def peek(self, tokens: Sequence[int], max_blocks: int, scope: Hashable = "") -> int:
        """How many of the first `max_blocks` full blocks of `tokens` are cached in `scope`, touching nothing: what a
        request would reuse here, asked before it is placed (router/core/placement.py)."""
        return len(self._chain(tokens, max_blocks, scope))

    def _chain(self, tokens: Sequence[int], max_blocks: int, scope: Hashable) -> list[Node]:
        found: list[Node] = []
        node = self._root(scope)
        if node is None:
            return found
        for chunk in self._chunks(tokens, max_blocks):
            child = node.children.get(block_hash(node.key, chunk))
            if child is None or child.tokens != chunk:
                break
            found.append(child)
            node = child
        return found

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], scope: Hashable = "") -> int:
        """Registers the caller's blocks along the chain of `tokens` in `scope`; see BlockAllocator.insert for the
        rules."""
        count = min(len(tokens) // self.block_size, len(blocks))
        parent = self._root(scope, create=count > 0)
        if parent is None:
            return 0
        now = self._tick()
        for i, chunk in enumerate(self._chunks(tokens, count)):
            key = block_hash(parent.key, chunk)
            node = parent.children.get(key)
            if node is None:
                node = self._register(parent, key, chunk, blocks[i], now)
            elif node.tokens != chunk or node.block != blocks[i]:
                return i  # a collision, or the same content computed into another block: keep ours private
            elif node.refcount == 0:
                raise ValueError(f"block {node.block} is cached but nobody holds it: insert only blocks you hold")
            parent = node
        return count

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference per occurrence; checks them all first so an error leaves the counts untouched."""
        for block, times in Counter(blocks).items():
            if self._nodes[block].refcount < times:
                raise RuntimeError(f"cached block {block} freed twice: its reference count would go below zero")
        now = self._tick()
        for block in blocks:
            node = self._nodes[block]
            node.refcount -= 1
            if node.refcount == 0:
                self._unreferenced += 1
                node.last_used = now
                if not node.children:
                    self._push(node)

    def evict(self) -> int | None:
        """Removes the least recently used unreferenced leaf and returns its block, or None when there is none."""
        while self._heap:
            stamp, _, _, node = heapq.heappop(self._heap)
            if self._evictable(node) and node.last_used == stamp:  # else a stale entry: a newer one exists or none
                self._remove(node)
                return node.block
        return None

    def _chunks(self, tokens: Sequence[int], limit: int) -> Iterator[tuple[int, ...]]:
        bs = self.block_size
        for i in range(min(len(tokens) // bs, limit)):
            yield tuple(tokens[i * bs : (i + 1) * bs])

    def _register(self, parent: Node, key: int, tokens: tuple[int, ...], block: int, now: int) -> Node:
        if block in self._nodes:
            raise ValueError(f"block {block} is already cached for other tokens")
        node = Node(block, tokens, key, parent, parent.depth + 1, refcount=1, last_used=now)
        parent.children[key] = node
        self._nodes[block] = node
        return node

    def _remove(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        del self._nodes[node.block]
        self._unreferenced -= 1
        if parent.parent is None:  # a scope's root
            if not parent.children:
                del self._roots[parent.tokens[0]]
        elif parent.refcount == 0 and not parent.children:
            self._push(parent)

    def _evictable(self, node: Node) -> bool:
        return self._nodes.get(node.block) is node and node.refcount == 0 and not node.children

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_used, -node.depth, self._pushes, node))
        self._pushes += 1
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drops stale entries, so a cache that is hit often but never short of blocks does not grow its heap."""
        self._heap = [e for e in self._heap if self._evictable(e[3]) and e[3].last_used == e[0]]
        heapq.heapify(self._heap)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
