"""The router's KV block pool and its prefix cache, without processes or a model."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from conveyor.router.core import prefix_cache
from conveyor.router.core.block_allocator import BlockAllocator

BS = 4


def seq(*blocks: int, tail: int = 0) -> list[int]:
    """Tokens made of whole blocks, block b being BS copies of b, plus `tail` extra tokens."""
    return [b for b in blocks for _ in range(BS)] + [99] * tail


def computed(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """What the scheduler does for a new request: reuse the cached prefix, allocate the rest, register it all."""
    blocks = allocator.match(tokens)
    fresh = allocator.allocate(allocator.blocks_for(len(tokens)) - len(blocks))
    assert fresh is not None
    blocks += fresh
    allocator.insert(tokens, blocks)
    return blocks


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0, BS)
    with pytest.raises(ValueError):
        BlockAllocator(4, 0)


def test_allocate_and_release_account_for_every_block() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    assert allocator.blocks_for(9) == 3 and allocator.blocks_for(8) == 2 and allocator.blocks_for(0) == 0
    first = allocator.allocate(3)
    assert first == [0, 1, 2] and allocator.free_blocks == 5
    second = allocator.allocate(5)
    assert second is not None and set(first).isdisjoint(second) and allocator.free_blocks == 0
    allocator.release(first)
    assert allocator.free_blocks == 3 and allocator.allocate(1) == [0]  # low ids first
    allocator.release([0])
    allocator.release(second)
    assert allocator.free_blocks == 8 and allocator.cached_blocks == 0


def test_a_refusal_takes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS)
    held = allocator.allocate(3)
    assert allocator.allocate(2) is None and allocator.free_blocks == 1
    assert allocator.allocate(1) == [3]
    assert held == [0, 1, 2]


def test_match_after_insert_returns_the_same_blocks_and_holds_them() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = seq(1, 2, 3)
    blocks = computed(allocator, tokens)
    assert allocator.cached_blocks == 3 and [allocator.refcount(b) for b in blocks] == [1, 1, 1]
    assert allocator.match(tokens) == blocks
    assert [allocator.refcount(b) for b in blocks] == [2, 2, 2]
    assert allocator.match(seq(1, 2, 7)) == blocks[:2]  # the longest cached prefix
    assert [allocator.refcount(b) for b in blocks] == [3, 3, 2]
    assert allocator.match(seq(7, 2, 3)) == []  # equal blocks after a different prefix are different KV


def test_partial_blocks_are_never_cached_or_matched() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = seq(1, 2, tail=3)
    blocks = computed(allocator, tokens)
    assert len(blocks) == 3 and allocator.cached_blocks == 2
    assert allocator.refcount(blocks[2]) is None  # the tail block stays private
    assert allocator.match(tokens) == blocks[:2]
    assert allocator.match(seq(1, tail=3)) == blocks[:1]  # 7 tokens hold one full block


def test_match_caps_at_max_blocks() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = seq(1, 2, 3)
    blocks = computed(allocator, tokens)
    assert allocator.match(tokens, max_blocks=2) == blocks[:2]
    assert allocator.match(tokens, max_blocks=0) == []
    assert allocator.refcount(blocks[2]) == 1  # beyond the cap: not held


def test_two_requests_sharing_a_prefix_share_its_blocks() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    a = computed(allocator, seq(1, 2, 3))
    b = computed(allocator, seq(1, 2, 5, tail=1))
    assert b[:2] == a[:2] and len(set(a) | set(b)) == 5
    assert allocator.free_blocks == 3 and allocator.cached_blocks == 4
    allocator.release(a)
    assert [allocator.refcount(x) for x in a] == [1, 1, 0]
    assert allocator.free_blocks == 4  # a's own third block is now evictable
    allocator.release(b)
    assert allocator.free_blocks == 8 and allocator.cached_blocks == 4


def test_insert_is_idempotent_and_extends_as_the_sequence_grows() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    blocks = allocator.allocate(3)
    tokens = seq(1, 2, tail=2)
    assert allocator.insert(tokens, blocks) == 2
    assert allocator.insert(tokens, blocks) == 2
    assert allocator.cached_blocks == 2 and [allocator.refcount(b) for b in blocks] == [1, 1, None]
    tokens += [99, 99]  # the third block fills up
    assert allocator.insert(tokens, blocks) == 3 and allocator.refcount(blocks[2]) == 1
    assert allocator.insert(tokens, blocks[:1]) == 1  # never beyond the blocks given


def test_insert_stops_at_a_block_computed_twice() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    tokens = seq(1, 2, 3)
    first = allocator.allocate(3)
    second = allocator.allocate(3)  # admitted before the first one's KV was registered
    assert allocator.insert(tokens, first) == 3
    assert allocator.insert(tokens, second) == 0
    assert all(allocator.refcount(b) is None for b in second)
    shared = allocator.match(tokens, max_blocks=1)
    third = shared + allocator.allocate(2)
    assert allocator.insert(tokens, third) == 1  # the shared block is registered; its own second block is not
    allocator.release(second)
    allocator.release(third)
    allocator.release(first)
    assert allocator.free_blocks == 8 and allocator.cached_blocks == 3


def test_insert_rejects_blocks_the_caller_does_not_hold() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    with pytest.raises(ValueError, match="free"):
        allocator.insert(seq(1), [0])
    blocks = computed(allocator, seq(1))
    allocator.release(blocks)
    with pytest.raises(ValueError, match="nobody holds"):
        allocator.insert(seq(1), blocks)


def test_released_cached_blocks_are_evicted_leaves_first_least_recently_used_first() -> None:
    allocator = BlockAllocator(num_blocks=6, block_size=BS)
    a = computed(allocator, seq(1, 2))  # blocks 0, 1
    b = computed(allocator, seq(3, 4))  # blocks 2, 3
    allocator.release(a)
    allocator.release(b)
    allocator.release(allocator.match(seq(1, 2)))  # a is now the more recently used
    assert allocator.free_blocks == 6 and allocator.cached_blocks == 4
    assert allocator.allocate(2) == [4, 5]  # the free list goes first
    assert allocator.allocate(1) == [b[1]]  # then b's leaf
    assert allocator.match(seq(3, 4)) == [b[0]]  # its content is gone; its parent still matches
    allocator.release([b[0]])  # ... and is now the most recently used
    assert allocator.allocate(1) == [a[1]]
    assert allocator.allocate(1) == [a[0]]
    assert allocator.allocate(1) == [b[0]]
    assert allocator.cached_blocks == 0 and allocator.free_blocks == 0
    assert allocator.match(seq(1, 2)) == [] and allocator.match(seq(3, 4)) == []
    assert allocator.stats.evictions == 4


def test_a_parent_outlives_its_children_even_when_used_less_recently() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=BS)
    parent, child = computed(allocator, seq(1, 2))
    allocator.release([parent])  # released in two calls: the parent is now the least recently used
    allocator.release([child])
    assert allocator.allocate(1) == [child]
    assert allocator.allocate(1) == [parent]


def test_a_hot_cache_keeps_its_eviction_heap_small_and_its_order_right() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS)
    cold = computed(allocator, seq(1))
    hot = computed(allocator, seq(2))
    allocator.release(cold + hot)
    for _ in range(1000):  # every release pushes a heap entry; the stale ones must not pile up
        allocator.release(allocator.match(seq(2)))
    assert len(allocator._cache._heap) <= 2 * allocator.cached_blocks + 64  # peeks inside: no public view
    assert allocator.allocate(3) == [2, 3, cold[0]]
    assert allocator.allocate(1) == hot


def test_blocks_someone_reads_are_never_evicted() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS)
    held = computed(allocator, seq(1, 2))
    dropped = computed(allocator, seq(3, 4))
    allocator.release(dropped)
    assert allocator.free_blocks == 2
    assert allocator.allocate(3) is None
    assert sorted(allocator.allocate(2) or []) == sorted(dropped)
    assert allocator.allocate(1) is None
    assert allocator.match(seq(1, 2)) == held


def test_a_hash_collision_never_returns_another_prefix_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent_key, tokens: 0)
    allocator = BlockAllocator(num_blocks=8, block_size=BS)
    a = computed(allocator, seq(1, 2))
    assert allocator.match(seq(1, 5)) == a[:1]  # the second block's key collides, its tokens do not
    assert allocator.match(seq(5, 2)) == []
    b = allocator.allocate(2)
    assert b is not None and allocator.insert(seq(5, 2), b) == 0  # the colliding key is taken: stays private
    allocator.release(b)
    assert allocator.free_blocks == 6 and allocator.cached_blocks == 2


def test_double_release_is_caught_and_changes_nothing() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS)
    private = allocator.allocate(1)
    cached = computed(allocator, seq(1))
    allocator.release(private)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.release(private)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.release(cached + cached)
    assert allocator.refcount(cached[0]) == 1
    allocator.release(cached)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.release(cached)
    fresh = allocator.allocate(1)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.release(fresh + fresh)
    assert allocator.free_blocks == 3
    with pytest.raises(ValueError):
        allocator.release([4])


def test_without_prefix_caching_it_is_a_plain_pool() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS, prefix_caching=False)
    tokens = seq(1, 2)
    blocks = allocator.allocate(2)
    assert blocks == [0, 1] and allocator.insert(tokens, blocks) == 0
    assert allocator.match(tokens) == [] and allocator.cached_blocks == 0
    allocator.release(blocks)
    assert allocator.free_blocks == 4 and allocator.allocate(4) == [0, 1, 2, 3]


@dataclass
class Request:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)


def check_pool(allocator: BlockAllocator, live: list[Request]) -> None:
    held: dict[int, int] = {}
    for request in live:
        assert len(set(request.blocks)) == len(request.blocks)
        for block in request.blocks:
            held[block] = held.get(block, 0) + 1
    assert allocator.free_blocks + len(held) == allocator.num_blocks
    for block, readers in held.items():
        assert not allocator.is_free(block)
        assert allocator.refcount(block) in (None, readers)
        assert readers == 1 or allocator.refcount(block) == readers  # only cached blocks are shared


def test_random_traffic_never_leaks_or_double_hands_out_blocks() -> None:
    rng = random.Random(1234)
    allocator = BlockAllocator(num_blocks=24, block_size=2)
    live: list[Request] = []
    for _ in range(4000):
        op = rng.random()
        if op < 0.35:
            request = Request([rng.randrange(2) for _ in range(rng.randrange(1, 12))])
            request.blocks = allocator.match(request.tokens, max_blocks=rng.choice([None, 1, 3]))
            fresh = allocator.allocate(allocator.blocks_for(len(request.tokens)) - len(request.blocks))
            if fresh is None:
                allocator.release(request.blocks)
            else:
                assert not set(fresh) & {b for r in live for b in r.blocks}
                request.blocks += fresh
                live.append(request)
        elif op < 0.6 and live:
            request = rng.choice(live)
            registered = allocator.insert(request.tokens, request.blocks)
            assert registered <= len(request.tokens) // 2
        elif op < 0.8 and live:
            request = rng.choice(live)  # decodes one token, taking a block when it crosses into a new one
            request.tokens.append(rng.randrange(2))
            needed = allocator.blocks_for(len(request.tokens)) - len(request.blocks)
            more = allocator.allocate(needed)
            if more is not None:
                request.blocks += more
            else:
                request.tokens.pop()
        elif live:
            request = live.pop(rng.randrange(len(live)))
            allocator.release(request.blocks)
        check_pool(allocator, live)
    assert allocator.stats.evictions > 0 and allocator.stats.hit_blocks > 0
    for request in live:
        allocator.release(request.blocks)
    assert allocator.free_blocks == allocator.num_blocks
    assert sorted(allocator.allocate(allocator.num_blocks) or []) == list(range(allocator.num_blocks))


def test_a_scope_reuses_only_its_own_cached_blocks_and_its_root_goes_with_its_last_block() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=BS)
    tokens = seq(1, 2, tail=1)
    blocks = allocator.allocate(3)
    assert allocator.insert(tokens, blocks, scope="key:ops") == 2
    assert allocator.match(tokens, scope="key:tenant") == []  # the same prompt, another key: nothing shared
    held = allocator.match(tokens, scope="key:ops")
    assert held == blocks[:2]
    allocator.release(held)
    allocator.release(blocks)
    cache = allocator._cache
    assert set(cache._roots) == {"key:ops"}
    while cache.evict() is not None:
        pass
    assert cache._roots == {}  # a scope leaves nothing behind once its blocks are gone (salts are unbounded)
