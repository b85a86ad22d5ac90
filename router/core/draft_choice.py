"""How many draft tokens each decoding sequence may have verified at a step: as many as pay for themselves.

A step verifying k drafts of one sequence feeds it k+1 rows. Reading the weights once serves every row, so on a
bandwidth-bound CPU extra rows are cheap, but never free: how cheap depends on the CPU, the dtype and the kernels,
so it is measured at warmup (the shards time a decode step at several row counts, `StepCosts`), not assumed. What a
draft earns is the chance it is accepted: the j-th draft of a step yields a token only if it and every draft before
it are accepted, so with a per-position acceptance `a` it is worth `a**j` tokens. The plan picks, over the whole
step, the drafts whose worth raises expected tokens per second the most, which may be none (a free chat rarely
repeats its prompt, and then the plain step is the faster one).

Each sequence's acceptance is learnt from its own steps (`DraftRecord`), starting from what every sequence so far
has shown (the pooled record), and forgets old steps, since prompt lookup accepts in bursts (a copied passage, then
new text). A sequence offered nothing learns nothing, so one that has not been verified for `PROBE_STEPS` steps is
offered a single draft: that bounds what a probe can cost to one step's extra row now and then.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from conveyor.router.transport.records import Calibration

FORGET = 0.9  # each step's weight in a sequence's record relative to the next one's: about its last ten count
POOLED_FORGET = 0.99  # ...in the pooled record, which a new sequence starts from: about the last hundred
PRIOR_TRIALS = 1.0  # how many positions' worth the pooled acceptance counts for in a new sequence's estimate
PROBE_STEPS = 16  # steps without a verified draft after which a sequence is offered one again


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one sequence's decode step at each calibrated row count (1 row: a plain decode step), and of
    one draft-model step (0.0 with prompt-lookup drafts, which cost nothing measurable)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    draft_step: float = 0.0

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"step costs need distinct ascending row counts, one time each: {self}")

    def at(self, rows: int) -> float:
        """The step's seconds at `rows`, linear between calibrated counts and past the last from its last slope."""
        r, s = self.rows, self.seconds
        i = bisect.bisect_left(r, rows)
        if i < len(r) and r[i] == rows:
            return s[i]
        if i == 0:
            return s[0]
        if i == len(r):
            i -= 1
            if i == 0:
                return s[0] * rows / r[0]
        slope = (s[i] - s[i - 1]) / (r[i] - r[i - 1])
        return s[i - 1] + slope * (rows - r[i - 1])

    def ratio(self, rows: int) -> float:
        """A step at `rows` against one at a single row: what /metrics shows as the verify cost."""
        return self.at(rows) / self.at(1)


def step_costs(calibration: Calibration | None) -> StepCosts | None:
    """The costs a warmup measured (None when it measured none: drafts off, or shards that could not). A step of
    more rows never costs less than one of fewer: a count timed faster than a smaller one (noise from whatever
    else ran meanwhile) takes the smaller one's time."""
    if calibration is None:
        return None
    seconds = tuple(itertools.accumulate(calibration.step_seconds, max))
    return StepCosts(calibration.rows, seconds, calibration.draft_step_seconds)


@dataclass
class DraftRecord:
    """A per-position acceptance estimate: accepted drafts over the positions tried (a step tries its drafts up
    to and including the first rejected one), each step weighted `FORGET` times the next."""

    accepted: float = 0.0
    tried: float = 0.0
    forget: float = FORGET
    idle_steps: int = 0  # steps since one of its drafts was last verified

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_TRIALS * prior) / (self.tried + PRIOR_TRIALS)

    def record(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and kept `accepted`; `drafted` 0 is a step without any."""
        if not drafted:
            self.idle_steps += 1
            return
        tried = accepted + (1 if accepted < drafted else 0)
        self.accepted = self.accepted * self.forget + accepted
        self.tried = self.tried * self.forget + tried
        self.idle_steps = 0


@dataclass
class DraftChooser:
    """The deployment's step costs and the acceptance pooled over every sequence, and the choice they make."""

    costs: StepCosts
    # Before any step: even odds, worth two positions.
    pooled: DraftRecord = field(default_factory=lambda: DraftRecord(accepted=1.0, tried=2.0, forget=POOLED_FORGET))

    @property
    def pooled_rate(self) -> float:
        return self.pooled.accepted / self.pooled.tried

    def record(self, record: DraftRecord, drafted: int, accepted: int) -> None:
        record.record(drafted, accepted)
        if drafted:
            self.pooled.record(drafted, accepted)

    def choose(self, records: list[DraftRecord], limits: list[int]) -> list[int]:
        """Draft budgets for one step of these sequences (limits[i]: the most sequence i may have), maximizing
        expected tokens per second of the step. Every candidate draft is ranked by its worth `a**j`, which falls
        with j, so the best set is a prefix of that ranking; the best prefix is kept (maybe the empty one)."""
        prior = self.pooled_rate
        rates = [r.rate(prior) for r in records]
        candidates = sorted(
            ((rate**j, i) for i, (rate, k) in enumerate(zip(rates, limits)) for j in range(1, k + 1)),
            key=lambda c: -c[0],
        )
        budgets, chosen = [0] * len(records), [0] * len(records)
        tokens, rows = float(len(records)), len(records)
        best = tokens / self.costs.at(rows)
        for worth, i in candidates:
            budgets[i] += 1
            tokens += worth
            rows += 1
            speed = tokens / (self.costs.at(rows) + self.costs.draft_step * max(budgets))
            if speed > best:
                best, chosen = speed, list(budgets)
        return [max(c, _probe(r, k)) for c, r, k in zip(chosen, records, limits)]


def _probe(record: DraftRecord, limit: int) -> int:
    return 1 if limit > 0 and record.idle_steps >= PROBE_STEPS else 0
