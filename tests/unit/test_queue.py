"""The waiting line without processes: priority first, then resumed sequences, then the API keys' fair shares by
virtual time (router/core/queue.py)."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import pytest

from conveyor.keys import ApiKey
from conveyor.router.core.queue import Queue
from conveyor.router.core.sequence import Sequence
from conveyor.router.pipeline.request import Parameters, ValidRequest

LIGHT, HEAVY = ApiKey("light", "light-key-1", weight=1), ApiKey("heavy", "heavy-key-1", weight=3)
_ids = itertools.count()


def request(key: ApiKey, prompt: int = 4, max_new_tokens: int = 12, priority: int = 0) -> Sequence:
    parameters = Parameters(max_new_tokens=max_new_tokens, priority=priority)
    return Sequence(id=next(_ids), request=ValidRequest("x", tuple(range(prompt)), parameters), key=key)


def drain(queue: Queue, n: int) -> list[Sequence]:
    return [queue.popleft() for _ in range(n)]


def test_two_flooding_keys_are_admitted_in_proportion_to_their_weights() -> None:
    queue = Queue()
    for _ in range(60):
        queue.append(request(LIGHT))
        queue.append(request(HEAVY))
    admitted = Counter(s.key.name for s in drain(queue, 40))
    assert admitted == {"light": 10, "heavy": 30}


def test_shares_are_by_tokens_not_by_requests() -> None:
    """A key sending requests four times as long gets a quarter as many admitted at equal weights."""
    small, large = ApiKey("small", "small-key-1"), ApiKey("large", "large-key-1")
    queue = Queue()
    for _ in range(40):
        queue.append(request(small, prompt=4, max_new_tokens=12))  # 16 tokens
        queue.append(request(large, prompt=4, max_new_tokens=60))  # 64 tokens
    admitted = Counter(s.key.name for s in drain(queue, 25))
    assert admitted == {"small": 20, "large": 5}


def test_a_key_that_waited_for_nothing_banks_no_credit() -> None:
    """A key that starts sending late does not then get the queue to itself to catch up: it takes turns at once."""
    late = ApiKey("late", "late-key-01")
    queue = Queue()
    for _ in range(50):
        queue.append(request(LIGHT))
    drain(queue, 30)  # light alone for a while: its clock ran on
    for _ in range(20):
        queue.append(request(late))
    admitted = [s.key.name for s in drain(queue, 10)]
    assert admitted.count("late") == 5 and admitted.count("light") == 5


def test_priority_comes_before_fair_shares() -> None:
    queue = Queue()
    heavy = [request(HEAVY) for _ in range(5)]
    urgent = request(LIGHT, priority=-1)
    for sequence in [*heavy, urgent]:
        queue.append(sequence)
    assert queue.popleft() is urgent
    assert queue.by_priority() == {0: 5}


def test_a_preempted_sequence_goes_back_first_and_is_not_charged_again() -> None:
    queue = Queue()
    first, second = request(LIGHT), request(HEAVY)
    queue.append(first)
    queue.append(second)
    resumed = queue.popleft()
    resumed.batched_at = time.monotonic()  # it ran, then was preempted
    queue.appendleft(resumed)
    newer = request(HEAVY)
    queue.append(newer)
    assert drain(queue, 3) == [resumed, second, newer]


def test_cancelled_requests_leave_the_line() -> None:
    queue = Queue()
    gone, stays = request(LIGHT), request(HEAVY)
    queue.append(gone)
    queue.append(stays)
    gone.cancelled = True
    assert len(queue) == 1 and queue.by_priority() == {0: 1}  # counted out before admission looks again
    assert queue.peek() is stays and queue.popleft() is stays
    with pytest.raises(IndexError):
        queue.popleft()


def test_each_group_takes_its_own_sequences_and_a_keys_share_is_charged_across_groups() -> None:
    """Two shard groups draw from one line: each takes only what was placed on it, and a key admitted in one group
    has its clock moved for the other too, so fair shares hold across groups."""
    from conveyor.router.core.queue import GroupQueue

    queue = Queue()
    first, second = GroupQueue(queue, 0), GroupQueue(queue, 1)
    l0, l1, l2, h0, h1 = request(LIGHT), request(LIGHT), request(LIGHT), request(HEAVY), request(HEAVY)
    for group, placed in ((first, l0), (first, l1), (second, l2), (second, h0), (first, h1)):
        group.append(placed)
    assert (len(first), len(second), len(queue)) == (3, 2, 5)
    assert second.popleft() is l2  # both clocks at 0: the earlier arrival; light is charged 16 tokens
    assert first.peek() is h1  # so in the other group heavy goes before light's older l0
    assert [first.popleft() for _ in range(3)] == [h1, l0, l1] and second.popleft() is h0
    assert first.peek() is None and second.peek() is None and len(queue) == 0
