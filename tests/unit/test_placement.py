"""Placement across shard groups (router/core/placement.py) and the prefix peek it relies on: the longest cached
prefix wins within the load bound, load wins past it, a group that is not serving gets nothing, and asking a pool
what it has cached holds no block and counts no query."""

from __future__ import annotations

import pytest

from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.placement import CacheAware, GroupView, NoGroup, Placed, RoundRobin


def views(*groups: tuple[int, int, bool]) -> list[GroupView]:
    return [GroupView(i, cached, load, serving) for i, (cached, load, serving) in enumerate(groups)]


def test_the_longest_cached_prefix_wins_within_the_load_bound() -> None:
    placement = CacheAware(max_extra_load=100)
    assert placement.choose(views((0, 0, True), (3, 90, True), (2, 0, True))) == Placed(1, "prefix")


def test_load_wins_past_the_bound() -> None:
    placement = CacheAware(max_extra_load=100)
    assert placement.choose(views((0, 10, True), (3, 200, True), (0, 50, True))) == Placed(0, "load")


def test_nothing_cached_anywhere_goes_to_the_least_loaded() -> None:
    assert CacheAware(100).choose(views((0, 30, True), (0, 20, True))) == Placed(1, "load")


def test_a_group_that_is_not_serving_gets_nothing() -> None:
    placement = CacheAware(max_extra_load=1000)
    assert placement.choose(views((5, 0, False), (1, 0, True))) == Placed(1, "prefix")
    assert RoundRobin().choose(views((0, 0, False), (0, 0, True))).group == 1
    with pytest.raises(NoGroup):
        placement.choose(views((5, 0, False)))


def test_round_robin_takes_the_serving_groups_in_turn() -> None:
    placement = RoundRobin()
    groups = views((9, 0, True), (0, 0, True), (0, 0, True))
    assert [placement.choose(groups).group for _ in range(4)] == [0, 1, 2, 0]


def test_asking_what_is_cached_holds_nothing_and_counts_no_query() -> None:
    pool = BlockAllocator(num_blocks=8, block_size=4, prefix_caching=True)
    tokens = list(range(10))  # two full blocks and a part
    blocks = pool.allocate(2)
    assert pool.insert(tokens, blocks, scope="a") == 2
    pool.release(blocks)
    stats_before, free_before = pool.stats, pool.free_blocks
    assert pool.cached_prefix(tokens, scope="a") == 2
    assert pool.cached_prefix(tokens[:6], scope="a") == 1 and pool.cached_prefix(tokens, scope="b") == 0
    assert pool.cached_prefix([99, *tokens[1:]], scope="a") == 0  # the chain breaks at the first block
    assert pool.free_blocks == free_before
    assert pool.stats == stats_before
    assert pool.match(tokens, scope="a") == blocks  # and the real match still finds and holds them
