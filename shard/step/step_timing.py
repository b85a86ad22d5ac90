"""What a decode step costs on this machine at a few row counts, timed at warmup for the router's draft choice.

A step verifying k drafts of one sequence feeds k+1 rows through the same weights, so it costs little more than a
one-row step where the GEMVs are bound by memory, and more where they are bound by compute or switch kernels:
that depends on the CPU, the dtype and the model, so it is timed here rather than assumed
(router/core/draft_choice.py weighs drafts by it). The steps run on the real pool before any request holds a
block, over a short context written first; every rank runs the same forwards, so tensor parallelism's
collectives pair up.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from conveyor.shard.batch.request_state import BadRequest
from conveyor.shard.speculation.verification import ForwardRows, one_token_rows

CONTEXT_TOKENS = 64  # a short conversation's context, so attention takes its usual small share of the step
REPEATS = 2  # timed runs per row count, after an untimed one; their median is kept
MOST_ROWS = 256  # a row count beyond any drafting step


def check_rows(rows: Sequence[int]) -> None:
    if len(rows) > 64 or any(r < 1 or r > MOST_ROWS for r in rows):
        raise BadRequest(f"calibrate_rows takes at most 64 row counts, each 1 to {MOST_ROWS}: got {list(rows)}")


@torch.inference_mode()
def time_decode_rows(engine, rows: Sequence[int]) -> tuple[list[float], float]:
    """Seconds of one sequence's decode step at each of `rows`, and of a one-row draft-model step (0.0 without
    a draft model). Nothing (and 0.0) when the pool cannot hold the context and the largest step."""
    check_rows(rows)
    steps = verify_steps(engine, rows) if rows else None
    if steps is None:
        return [], 0.0
    seconds = [_median_seconds(steps[count], engine.device) for count in rows]
    drafter = engine.drafter
    if drafter is None:
        return seconds, 0.0
    draft_step = verify_steps(engine, [1], model=drafter.model, cache=drafter.cache)
    return seconds, _median_seconds(draft_step[1], engine.device)


def verify_steps(engine, rows: Sequence[int], **target) -> dict[int, Callable[[], object]] | None:
    """One sequence's decode step of `count` rows (count-1 drafts verified, as the engine runs it: one row per
    token) for each count in `rows`, over a CONTEXT_TOKENS context written here first (`target`: another model
    and cache, a draft model's). None when the pool cannot hold the context and the largest step. The steps
    rewrite the same slots, so each may run any number of times (benchmarks/verify_rows.py times them too)."""
    if not rows:
        return {}
    blocks = list(range(math.ceil((CONTEXT_TOKENS + max(rows)) / engine.block_size)))
    if len(blocks) > engine.cache.num_blocks:
        return None

    def step(count: int) -> Callable[[], object]:
        rows = ForwardRows([[1] * count], [CONTEXT_TOKENS], [blocks], [CONTEXT_TOKENS + count], [count])
        rows = one_token_rows(rows, [True])
        args = (rows.new_tokens, rows.starts, rows.blocks, rows.lengths, rows.logit_counts)
        return lambda: engine.forward(*args, **target)

    engine.forward([[1] * CONTEXT_TOKENS], [0], [blocks], [CONTEXT_TOKENS], [1], **target)
    return {count: step(count) for count in rows}


def _median_seconds(run: Callable[[], object], device: torch.device) -> float:
    times = []
    for attempt in range(REPEATS + 1):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if attempt:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
