"""Crash replay's rule: after a failed step, who goes back to the queue and who is blamed.

A step that fails loses the shards' batch. Every sequence in it goes back to the front of the queue, to be
recomputed from its prompt and the tokens it already streamed (as after a preemption: its stream goes on with no
gap and no duplicate). The failure is blamed on the suspects in the step if there are any (sequences replayed
after an earlier failure that have not read their tokens back yet: they join alone, see StepPlanner._admit), else
on every sequence in it; one blamed more than `max_retries` times ends with an error instead, so that a prompt
that kills the shards every time cannot kill them for ever. The scheduler (router/core/scheduler.py) replays
after every failed step.
"""

from __future__ import annotations

from conveyor.router.core.step_planner import StepPlanner


def replay(planner: StepPlanner, max_retries: int, message: str) -> int:
    """Puts the planner's running sequences back in the queue, in their order, as suspects (or fails those blamed
    too often, with `message`: the failed step's error); returns how many went back."""
    failed = list(planner.running)
    blamed = [s for s in failed if s.suspect] or failed
    replayed = 0
    for sequence in reversed(failed):  # each goes to the front: in reverse, they keep their order
        if sequence.is_finished or sequence.cancelled:
            planner.remove(sequence)
            continue
        sequence.num_replays += sequence in blamed
        if sequence.num_replays > max_retries:
            planner.remove(sequence)
            sequence.fail(f"the request was in {sequence.num_replays} failed steps, the last: {message}")
            continue
        sequence.suspect = True
        planner.requeue(sequence)
        replayed += 1
    return replayed
