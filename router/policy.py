"""When may queued requests join, and how many: the batching policy as plain functions.

The rule is TGI's. An idle server admits whatever fits the prefill and token budgets. A running batch is
paused for a prefill only when enough requests wait (`waiting_served_ratio` times the running batch size), or
when it has decoded `max_waiting_tokens` steps in a row without anyone joining, whichever comes first:
pausing costs every running stream one prefill's latency, so it is paid for enough newcomers at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None = None
    waiting_served_ratio: float = 0.3
    max_waiting_tokens: int = 20


@dataclass(frozen=True)
class Admission:
    """Limits on the next batch taken from the queue."""

    prefill_budget: int
    token_budget: int
    min_size: int | None = None  # take nothing unless at least this many fit
    max_size: int | None = None  # take at most this many


def admission_when_idle(config: BatchingConfig) -> Admission:
    return Admission(
        prefill_budget=config.max_batch_prefill_tokens,
        token_budget=config.max_batch_total_tokens,
        max_size=config.max_batch_size,
    )


def admission_when_running(
    config: BatchingConfig, running_size: int, running_max_tokens: int, waiting_steps: int
) -> Admission:
    """Limits for joining a running batch that has decoded `waiting_steps` steps since anyone last joined."""
    if waiting_steps >= config.max_waiting_tokens:
        min_size = None
    else:
        min_size = math.floor(running_size * config.waiting_served_ratio) or None
    max_size = None if config.max_batch_size is None else max(config.max_batch_size - running_size, 0)
    return Admission(
        prefill_budget=config.max_batch_prefill_tokens,
        token_budget=max(config.max_batch_total_tokens - running_max_tokens, 0),
        min_size=min_size,
        max_size=max_size,
    )
