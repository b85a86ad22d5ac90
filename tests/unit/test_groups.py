"""Placing requests across shard groups that share one line (router/core/groups.py), without processes: a prompt
whose prefix one group has cached goes there within the load bound; a group that recovers gets nothing; each
group's scheduler admits only what was placed on it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.groups import Groups, load
from conveyor.router.core.placement import CacheAware, RoundRobin
from conveyor.router.core.queue import GroupQueue, Queue
from conveyor.router.core.scheduler import Scheduler
from conveyor.router.core.sequence import Sequence
from conveyor.router.core.step_planner import PlannerConfig
from conveyor.router.metrics import Metrics
from conveyor.router.pipeline.request import Parameters, ValidRequest
from conveyor.router.transport.connect import check_same_model
from conveyor.router.transport.records import ShardInfo

BLOCK = 16


def groups(count: int, placement) -> Groups:
    queue, metrics = Queue(), Metrics()  # one set of metrics, as the router has
    schedulers = [
        Scheduler(
            None,
            PlannerConfig(max_batch_prefill_tokens=1000),
            BlockAllocator(64, BLOCK),
            metrics,
            queue=GroupQueue(queue, i),
        )
        for i in range(count)
    ]
    return Groups(schedulers, queue, placement)


def sequence(n: int, prompt: list[int], max_new_tokens: int = 10) -> Sequence:
    request = ValidRequest("x", tuple(prompt), Parameters(max_new_tokens=max_new_tokens))
    return Sequence(id=n, request=request)


def cache(scheduler: Scheduler, prompt: list[int], scope) -> None:
    """As if a request with this prompt had run on the group and finished: its full blocks cached, unheld."""
    blocks = scheduler.allocator.allocate(len(prompt) // BLOCK)
    scheduler.allocator.insert(prompt, blocks, scope)
    scheduler.allocator.release(blocks)


def test_a_cached_prefix_draws_its_request_and_each_group_admits_only_its_own() -> None:
    front = groups(2, CacheAware(max_extra_load=10_000))
    system = list(range(3 * BLOCK))
    probe = sequence(0, [*system, 900, 901])
    cache(front.schedulers[1], system, probe.cache_scope)
    front.submit(probe)
    assert probe.group == 1
    other = sequence(1, [500 + i for i in range(40)])
    front.submit(other)
    assert other.group == 0  # nothing cached anywhere: the least loaded
    assert front.schedulers[0].queue.peek() is other and front.schedulers[1].queue.peek() is probe
    assert load(front.schedulers[1]) == len(probe.token_ids) + 10


def test_a_recovering_group_gets_nothing_and_round_robin_ignores_caches() -> None:
    front = groups(2, CacheAware(max_extra_load=10_000))
    system = list(range(2 * BLOCK))
    first = sequence(0, [*system, 7])
    cache(front.schedulers[0], system, first.cache_scope)
    front.schedulers[0].recovering = True
    front.submit(first)
    assert first.group == 1 and not front.recovering
    blind = groups(2, RoundRobin())
    cache(blind.schedulers[1], system, first.cache_scope)
    placed = [sequence(n, [*system, n]) for n in range(3)]
    for s in placed:
        blind.submit(s)
    assert [s.group for s in placed] == [0, 1, 0]


def gauges(front: Groups, name: str) -> list[float]:
    """A group-labelled gauge's value for each group, as /metrics would show it now."""
    registry = front.metrics.registry
    return [registry.get_sample_value(f"conveyor_{name}", {"group": str(i)}) for i in range(len(front.schedulers))]


def test_a_failed_or_drained_group_sends_its_waiting_requests_to_the_others() -> None:
    front = groups(3, CacheAware(max_extra_load=10_000))
    waiting = [sequence(n, [100 + n] * 20) for n in range(4)]
    for s in waiting:
        front.schedulers[0].submit(s)  # as if all had been placed on group 0 (say, before the others joined)
    front.schedulers[0].recovering = front.schedulers[2].recovering = True
    front.move_waiting(0)  # what Scheduler._recover calls after it put its running sequences back in the line
    assert {s.group for s in waiting} == {1}  # the one group that serves
    front.schedulers[0].recovering = False  # group 0 rejoined
    assert gauges(front, "group_queue_size") == [0, 4, 0]  # at once, not at each group's next step
    front.drain(1)
    assert {s.group for s in waiting} == {0} and front.schedulers[1].status == "draining"
    assert gauges(front, "group_queue_size") == [4, 0, 0] and gauges(front, "group_serving") == [1, 0, 0]
    late = sequence(9, [7] * 20)
    front.submit(late)
    assert late.group == 0  # neither the drained nor the recovering group gets new work
    front.resume(1)
    assert front.schedulers[1].serving and gauges(front, "group_serving") == [1, 1, 0]
    registry = front.metrics.registry
    assert registry.get_sample_value("conveyor_queue_size") == 5
    for group in ("0", "1"):
        assert registry.get_sample_value("conveyor_placements_total", {"group": group, "reason": "moved"}) == 4


def test_with_every_group_down_a_request_waits_on_the_least_loaded_and_abort_ends_every_one() -> None:
    front = groups(2, RoundRobin())
    for scheduler in front.schedulers:
        scheduler.recovering = True
    first, second = sequence(0, [1] * 20, 50), sequence(1, [2] * 20)
    front.submit(first)
    front.submit(second)
    assert (first.group, second.group) == (0, 1) and front.recovering
    front.move_waiting(0)  # nowhere to go: it stays
    assert first.group == 0
    front.abort("stopping")
    assert len(front.queue) == 0 and first.is_finished and second.is_finished


def test_info_shows_each_group_and_the_pools_together() -> None:
    front = groups(2, CacheAware(max_extra_load=0))
    front.submit(sequence(0, [5] * 40))
    info = front.describe()
    assert info["placement"] == "cache-aware" and info["kv_blocks_total"] == 128
    assert [(g["index"], g["status"], g["waiting"], g["placed"]) for g in info["groups"]] == [
        (0, "serving", 1, 1),
        (1, "serving", 0, 0),
    ]


def test_a_group_that_serves_another_model_is_refused() -> None:
    first = ShardInfo(dtype="float32", model_type="llama", max_position_embeddings=1024, pid=1, instance="a")
    check_same_model(first, replace(first, pid=2, instance="b", weight_bytes=9), "unix:///run/s-g1-0")  # same model
    with pytest.raises(ValueError, match="tcp://far:1 serves another model.*dtype 'bfloat16'"):
        check_same_model(first, replace(first, dtype="bfloat16"), "tcp://far:1")
