"""The router's KV blocks and paged admission, without processes or a model."""

from __future__ import annotations

import pytest

from conveyor.router.block_allocator import BlockAllocator
from conveyor.router.policy import Admission
from conveyor.router.queue import Queue, kv_tokens, release
from test_policy import entry, ids, queue_of

ROOMY = Admission(prefill_budget=10_000, token_budget=10**9)


def test_allocation_covers_the_tokens_with_whole_blocks_and_their_slots() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    a = allocator.allocate(10)
    assert len(a.blocks) == 3 and allocator.free_blocks == 5
    assert a.slots == tuple(a.blocks[p // 4] * 4 + p % 4 for p in range(10))
    assert len(set(a.slots)) == 10


def test_never_more_blocks_than_exist() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    first = allocator.allocate(12)
    assert allocator.allocate(8) is None and allocator.free_blocks == 1  # a refusal takes nothing
    second = allocator.allocate(4)
    assert set(first.blocks).isdisjoint(second.blocks) and allocator.free_blocks == 0
    allocator.free(first)
    allocator.free(second)
    assert allocator.free_blocks == 4


def test_double_free_is_caught() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    a = allocator.allocate(8)
    allocator.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(a)


def test_paged_admission_counts_real_prompt_tokens_not_padding() -> None:
    # Padded, 3 prompts of 10, 30, 20 cost 90; paged they cost 60.
    q = queue_of(entry(0, 10), entry(1, 30), entry(2, 20), entry(3, 50))
    batch = q.next_batch(Admission(prefill_budget=60, token_budget=10**9), BlockAllocator(100, 16))
    assert ids(batch) == [0, 1, 2]


def test_paged_admission_stops_when_blocks_run_out_and_holds_them() -> None:
    allocator = BlockAllocator(num_blocks=4, block_size=16)  # 64 slots
    q = queue_of(entry(0, 20, max_new_tokens=13), entry(1, 20, max_new_tokens=13), entry(2, 5, max_new_tokens=5))
    batch = q.next_batch(ROOMY, allocator)
    assert ids(batch) == [0, 1]  # 32 slots = 2 blocks each; the third would need a fifth block
    assert kv_tokens(batch.entries[0]) == 32 and batch.max_tokens == 4 * 16
    assert allocator.free_blocks == 0 and all(e.allocation for e in batch.entries)
    assert q.next_batch(ROOMY, allocator) is None and len(q) == 1
    release(batch.entries[0], allocator)
    assert ids(q.next_batch(ROOMY, allocator)) == [2]


def test_a_batch_held_back_by_min_size_gives_its_blocks_back() -> None:
    allocator = BlockAllocator(num_blocks=10, block_size=16)
    q = queue_of(entry(0, 5), entry(1, 5))
    assert q.next_batch(Admission(prefill_budget=100, token_budget=10**9, min_size=2), allocator) is not None
    q = queue_of(entry(2, 5), entry(3, 500))  # the second does not fit the prefill budget
    allocator = BlockAllocator(num_blocks=10, block_size=16)
    assert q.next_batch(Admission(prefill_budget=100, token_budget=10**9, min_size=2), allocator) is None
    assert allocator.free_blocks == 10 and all(e.allocation is None for e in q.drain())


def test_release_is_idempotent_per_entry() -> None:
    allocator = BlockAllocator(num_blocks=2, block_size=16)
    e = entry(0, 5)
    Queue.next_batch(queue_of(e), ROOMY, allocator)
    release(e, allocator)
    release(e, allocator)
    assert allocator.free_blocks == 2
