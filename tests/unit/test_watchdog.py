"""The shard's step deadline and health report on a fake clock (tests/e2e/test_shard_service.py runs a real stuck
shard)."""

from __future__ import annotations

from conveyor.shard.service.health_report import NOT_SERVING, SERVING, SHARD_SERVICE, HealthReport
from conveyor.shard.service.watchdog import MIN_STEP_TIMEOUT, STEP_TIMEOUT_WARMUPS, StepWatch, step_timeout


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Health:
    """The health servicer's `set`, recorded."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.changes = 0

    async def set(self, service: str, status: int) -> None:
        self.status[service] = status
        self.changes += 1


def test_the_step_deadline_is_the_one_asked_for_else_ten_warmups_and_at_least_a_minute() -> None:
    assert step_timeout(5.0, 100.0) == 5.0
    assert step_timeout(0.0, 1.0) == MIN_STEP_TIMEOUT
    assert step_timeout(0.0, 30.0) == 30.0 * STEP_TIMEOUT_WARMUPS


def test_a_step_is_stuck_only_past_the_deadline_and_only_while_it_runs() -> None:
    clock = Clock()
    watch = StepWatch(clock=clock)
    with watch.step():
        clock.now += 1000
        assert watch.stuck() is None  # no deadline before the warmup chose one
        watch.timeout = 10.0
        assert "past the step timeout of 10 s" in watch.stuck()
    assert watch.stuck() is None and watch.running_for() == 0.0
    with watch.step():
        clock.now += 10.0
        assert watch.stuck() is None  # at the deadline, not past it
        with watch.step():  # a second call queued behind it: the oldest one counts
            clock.now += 0.5
            assert watch.running_for() == 10.5 and watch.stuck() is not None


async def test_health_turns_not_serving_past_the_deadline_and_back_when_the_step_ends() -> None:
    clock, health = Clock(), Health()
    watch = StepWatch(timeout=10.0, clock=clock)
    report = HealthReport(watch, health)
    await report.set(SERVING)
    with watch.step():
        await report.update()
        assert health.status == {"": SERVING, SHARD_SERVICE: SERVING}
        clock.now += 11
        await report.update()
        assert health.status == {"": NOT_SERVING, SHARD_SERVICE: NOT_SERVING}
        changes = health.changes
        await report.update()
        assert health.changes == changes  # told once
    await report.update()
    assert health.status == {"": SERVING, SHARD_SERVICE: SERVING}
