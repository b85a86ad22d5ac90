"""The admission policy and the queue's batch picking, driven without processes or a model."""

from __future__ import annotations

from conveyor.router.policy import Admission, BatchingConfig, admission_when_idle, admission_when_running
from conveyor.router.queue import Entry, Queue
from conveyor.router.validation import Parameters, ValidRequest

CONFIG = BatchingConfig(
    max_batch_prefill_tokens=100,
    max_batch_total_tokens=1000,
    max_batch_size=8,
    waiting_served_ratio=0.5,
    max_waiting_tokens=10,
)


def entry(n: int, input_length: int, max_new_tokens: int = 10) -> Entry:
    request = ValidRequest(
        inputs="x" * input_length,
        input_ids=tuple(range(input_length)),
        parameters=Parameters(max_new_tokens=max_new_tokens),
    )
    return Entry(id=n, request=request)


def queue_of(*entries: Entry) -> Queue:
    q = Queue()
    for e in entries:
        q.append(e)
    return q


def ids(batch) -> list[int]:
    return [e.id for e in batch.entries]


# --- policy -------------------------------------------------------------------------------------------------


def test_idle_server_admits_up_to_the_budgets() -> None:
    admission = admission_when_idle(CONFIG)
    assert admission == Admission(prefill_budget=100, token_budget=1000, min_size=None, max_size=8)


def test_running_batch_pauses_only_for_enough_waiting_requests() -> None:
    admission = admission_when_running(CONFIG, running_size=6, running_max_tokens=400, waiting_steps=1)
    assert admission.min_size == 3  # floor(6 * 0.5)
    assert admission.max_size == 2  # 8 - 6
    assert admission.token_budget == 600  # 1000 - 400


def test_after_max_waiting_tokens_any_single_request_may_join() -> None:
    admission = admission_when_running(CONFIG, running_size=6, running_max_tokens=400, waiting_steps=10)
    assert admission.min_size is None


def test_small_running_batch_admits_a_single_newcomer() -> None:
    admission = admission_when_running(CONFIG, running_size=1, running_max_tokens=50, waiting_steps=1)
    assert admission.min_size is None  # floor(1 * 0.5) == 0: no minimum


def test_full_batch_admits_nobody() -> None:
    admission = admission_when_running(CONFIG, running_size=8, running_max_tokens=50, waiting_steps=99)
    assert admission.max_size == 0
    assert queue_of(entry(0, 5)).next_batch(admission) is None


def test_exhausted_token_budget_admits_nobody() -> None:
    admission = admission_when_running(CONFIG, running_size=2, running_max_tokens=1200, waiting_steps=99)
    assert admission.token_budget == 0
    assert queue_of(entry(0, 5)).next_batch(admission) is None


# --- queue ----------------------------------------------------------------------------------------------------


def test_prefill_budget_counts_padded_tokens() -> None:
    # 3 prompts padded to the longest (30) cost 90 prefill tokens; a 4th would cost 4 * 30 = 120 > 100.
    q = queue_of(entry(0, 10), entry(1, 30), entry(2, 20), entry(3, 5))
    batch = q.next_batch(Admission(prefill_budget=100, token_budget=10_000))
    assert ids(batch) == [0, 1, 2]
    assert batch.max_tokens == 3 * 30 + 3 * 10
    assert len(q) == 1


def test_token_budget_counts_prompt_and_new_tokens() -> None:
    q = queue_of(entry(0, 10, max_new_tokens=50), entry(1, 10, max_new_tokens=50))
    # The first costs 10 + 50 = 60; both cost 2 * 10 + 100 = 120.
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=100))) == [0]
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=100))) == [1]


def test_min_size_holds_back_until_enough_fit() -> None:
    q = queue_of(entry(0, 10), entry(1, 10))
    assert q.next_batch(Admission(prefill_budget=100, token_budget=1000, min_size=3)) is None
    assert len(q) == 2  # nothing was taken
    q.append(entry(2, 10))
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=1000, min_size=3))) == [0, 1, 2]


def test_min_size_counts_what_fits_not_what_waits() -> None:
    q = queue_of(entry(0, 60), entry(1, 60), entry(2, 60))  # only one fits the prefill budget
    assert q.next_batch(Admission(prefill_budget=100, token_budget=1000, min_size=2)) is None
    assert len(q) == 3


def test_max_size_caps_the_batch() -> None:
    q = queue_of(*(entry(n, 1) for n in range(5)))
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=1000, max_size=2))) == [0, 1]


def test_an_entry_that_does_not_fit_keeps_its_place() -> None:
    q = queue_of(entry(0, 90), entry(1, 5))
    first = q.next_batch(Admission(prefill_budget=100, token_budget=1000))
    assert ids(first) == [0]  # 2 * 90 > 100: the small one is not pulled ahead into this batch
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=1000))) == [1]


def test_cancelled_entries_are_dropped_before_batching() -> None:
    a, b, c = entry(0, 5), entry(1, 5), entry(2, 5)
    b.cancelled = True
    q = queue_of(a, b, c)
    assert ids(q.next_batch(Admission(prefill_budget=100, token_budget=1000))) == [0, 2]
    assert len(q) == 0


def test_empty_queue_gives_nothing() -> None:
    assert Queue().next_batch(admission_when_idle(CONFIG)) is None
