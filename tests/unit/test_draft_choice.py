"""The router's draft choice: drafts are offered where the measured step costs and the acceptance so far say they
raise tokens per second, and not elsewhere."""

from __future__ import annotations

import pytest

from conveyor.router.core.draft_choice import PROBE_STEPS, DraftChooser, DraftRecord, StepCosts, step_costs
from conveyor.router.transport.connect import calibration_rows
from conveyor.router.transport.records import Calibration
from conveyor.shard.step import step_timing

# A bandwidth-bound CPU: extra rows of one step are nearly free up to 9, then cost like compute.
CHEAP_ROWS = StepCosts((1, 2, 3, 5, 9, 18, 36), (0.020, 0.0205, 0.021, 0.022, 0.024, 0.040, 0.075))
# A compute-bound one: every row costs what the first does.
LINEAR_ROWS = StepCosts((1, 9), (0.010, 0.090))


def learnt(accepted: int, drafted: int, chooser: DraftChooser | None = None, steps: int = 20) -> DraftRecord:
    """A sequence's record after `steps` steps that each kept `accepted` of `drafted` (and the pool's too)."""
    record = DraftRecord()
    for _ in range(steps):
        if chooser is None:
            record.record(drafted, accepted)
        else:
            chooser.record(record, drafted, accepted)
    return record


def test_costs_interpolate_between_and_extend_past_calibrated_rows() -> None:
    costs = StepCosts((1, 3, 5), (0.010, 0.014, 0.020))
    assert costs.at(1) == 0.010 and costs.at(5) == 0.020
    assert costs.at(2) == pytest.approx(0.012)
    assert costs.at(4) == pytest.approx(0.017)
    assert costs.at(7) == pytest.approx(0.026)  # the last slope goes on
    assert costs.ratio(5) == pytest.approx(2.0)
    assert StepCosts((4,), (0.02,)).at(8) == pytest.approx(0.04)
    with pytest.raises(ValueError):
        StepCosts((3, 1), (0.1, 0.2))
    with pytest.raises(ValueError):
        StepCosts((1, 2), (0.1,))


def test_a_record_counts_the_first_rejected_position_as_tried() -> None:
    record = DraftRecord(forget=1.0)
    record.record(drafted=4, accepted=4)  # all four tried and kept
    record.record(drafted=4, accepted=1)  # one kept, the second tried and rejected, two never tried
    assert (record.accepted, record.tried) == (5, 6)
    record.record(drafted=0, accepted=0)
    assert (record.accepted, record.tried, record.idle_steps) == (5, 6, 1)


def test_low_acceptance_gets_no_drafts_and_high_acceptance_gets_many() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    assert chooser.choose([learnt(accepted=0, drafted=8, chooser=chooser)], [8]) == [0]
    chooser = DraftChooser(CHEAP_ROWS)
    assert chooser.choose([learnt(accepted=8, drafted=8, chooser=chooser)], [8]) == [8]
    chooser = DraftChooser(CHEAP_ROWS)
    middling = chooser.choose([learnt(accepted=2, drafted=8, chooser=chooser)], [8])[0]
    assert 0 < middling < 8


def test_a_request_never_gets_more_than_its_limit() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    assert chooser.choose([learnt(8, 8), learnt(8, 8)], [3, 0]) == [3, 0]


def test_when_every_row_costs_a_step_no_draft_pays() -> None:
    chooser = DraftChooser(LINEAR_ROWS)
    assert chooser.choose([learnt(accepted=7, drafted=8)], [8]) == [0]


def test_an_expensive_draft_model_is_asked_for_fewer_drafts() -> None:
    record = learnt(accepted=2, drafted=4)
    free = DraftChooser(CHEAP_ROWS).choose([record], [8])[0]
    costly = DraftChooser(StepCosts(CHEAP_ROWS.rows, CHEAP_ROWS.seconds, draft_step=0.004)).choose([record], [8])[0]
    assert costly < free


def test_the_sequence_that_accepts_more_gets_the_drafts_first() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    good, poor = learnt(accepted=7, drafted=8, chooser=chooser), learnt(accepted=0, drafted=8, chooser=chooser)
    budgets = chooser.choose([poor, good], [8, 8])
    assert budgets[1] > budgets[0] == 0


def test_a_new_sequence_starts_from_the_pooled_acceptance() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    for _ in range(200):  # every sequence so far rejected its drafts
        chooser.record(DraftRecord(), drafted=8, accepted=0)
    assert chooser.pooled_rate < 0.05
    assert chooser.choose([DraftRecord()], [8]) == [0]
    for _ in range(400):
        chooser.record(DraftRecord(), drafted=8, accepted=8)
    assert chooser.choose([DraftRecord()], [8]) == [8]


def test_a_sequence_offered_nothing_is_probed_with_one_draft_now_and_then() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    record = learnt(accepted=0, drafted=8, chooser=chooser)
    offered = []
    for _ in range(2 * PROBE_STEPS + 2):
        budget = chooser.choose([record], [8])[0]
        offered.append(budget)
        chooser.record(record, drafted=budget, accepted=0)
    assert offered.count(1) == 2 and set(offered) == {0, 1}
    assert offered.index(1) == PROBE_STEPS


def test_a_probe_that_is_accepted_brings_the_drafts_back() -> None:
    chooser = DraftChooser(CHEAP_ROWS)
    record = learnt(accepted=0, drafted=8, chooser=chooser)
    budgets = [1]  # a probe: the text turned into a copy of the prompt, and from now on every draft is accepted
    while budgets[-1] < 8 and len(budgets) < 10:
        chooser.record(record, drafted=budgets[-1], accepted=budgets[-1])
        budgets.append(chooser.choose([record], [8])[0])
    assert budgets[-1] == 8 and budgets == sorted(budgets), budgets


def test_a_warmup_without_times_gives_no_costs() -> None:
    assert step_costs(None) is None
    assert step_costs(Calibration((1, 2), (0.01, 0.011))).at(2) == 0.011
    noisy = step_costs(Calibration((1, 2, 3, 4), (0.02, 0.018, 0.025, 0.021)))  # 2 and 4 rows timed too fast
    assert noisy.seconds == (0.02, 0.02, 0.025, 0.025)


def test_the_rows_asked_for_are_rows_a_shard_times() -> None:
    """The router asks the shards to time every row count of one verify step and two larger ones, never more than
    a shard accepts (it refuses the warmup otherwise, and the deployment never starts)."""
    assert calibration_rows(0, 4) == ()
    assert calibration_rows(8, 4) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 18, 36)
    assert calibration_rows(4, 64) == (1, 2, 3, 4, 5, 32, 64)  # a big drafting batch: its cost extrapolated
    for speculate in range(0, 17):
        for max_batch in (1, 4, 64, 1000):
            step_timing.check_rows(calibration_rows(speculate, max_batch))
