"""Soak: many requests of every generating route at once through a real deployment whose KV pool is small
enough that requests are preempted, with about one client in ten hanging up before its first token, right
after it, mid-stream, or (not streaming) while it waits. Nothing is lost, every stream ends exactly once, every
KV block comes back, and /metrics agrees with what the clients saw.

The shard is SIGKILLed during the run (CONVEYOR_SOAK_KILLS times, evenly spread): the requests it cuts are
replayed, so the same holds. CI runs a small count and one kill; `make soak` runs 1,000 requests and three
kills (CONVEYOR_SOAK_REQUESTS, CONVEYOR_SOAK_KILLS) and prints the figures. Loopback only.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter

import httpx
import pytest
from clients import (
    HangUp,
    Result,
    check,
    http_client,
    outcomes,
    perform_all,
    random_call,
    sample,
    scrape,
    wait_until,
    wait_until_idle,
)
from conftest import Server

REQUESTS = int(os.environ.get("CONVEYOR_SOAK_REQUESTS", "200"))
# Shard kills spread over the run (SIGKILL, as an OOM kill): every request they cut is replayed, none lost.
KILLS = int(os.environ.get("CONVEYOR_SOAK_KILLS", "1"))
SEED = int(os.environ.get("CONVEYOR_SOAK_SEED", "11"))
CONCURRENCY = 48
HANG_UP_SHARE = 0.1
# The deployment is conftest's `small_kv`, shared with other modules: 32 blocks of 16 tokens, which a few dozen
# requests of up to ~100 prompt tokens plus 64 new ones outgrow. Its counters are read as differences.
# Generous bounds, so that only a hang trips them: the whole run, and each read of each request.
RUN_LIMIT = 60 + REQUESTS * 0.5 + KILLS * 60
READ_TIMEOUT = 120


def lost(result: Result) -> str | None:
    """Why a request counts as lost: one read to its end that is not a whole, well-formed answer, or one whose
    client hung up after an error or a failed connection (a hang-up itself loses nothing)."""
    if not result.hung_up:
        return check(result)
    if result.error is not None or result.status not in (200, None):  # None: not streaming, no answer yet
        return f"before hanging up: status {result.status}, {result.error or result.body}"
    errors = [e for e in result.events if isinstance(e, dict) and "error" in e]
    return f"error event before hanging up: {errors[0]}" if errors else None


async def kill_shards(server: Server, probe: httpx.AsyncClient) -> None:
    """SIGKILLs the shard each time another 1/(KILLS+1) of the requests have succeeded, once it is serving."""
    for kill in range(1, KILLS + 1):

        async def due(kill: int = kill) -> bool:
            served = outcomes(await scrape(probe)).get("success", 0.0)
            return served >= REQUESTS * kill / (KILLS + 1) and (await probe.get("/health")).status_code == 200

        await wait_until(due, RUN_LIMIT, f"kill {kill} to be due")
        os.kill(server.shard_pid(0), signal.SIGKILL)


@pytest.mark.timeout(RUN_LIMIT + 240)
async def test_soak_loses_nothing_and_leaks_nothing(small_kv: Server) -> None:
    rng = random.Random(SEED)
    calls = [random_call(rng, HANG_UP_SHARE) for _ in range(REQUESTS)]
    async with http_client(small_kv.url, 4) as probe:
        before = await scrape(probe)
        start = time.monotonic()
        killer = asyncio.create_task(kill_shards(small_kv, probe))
        results = await perform_all(small_kv.url, calls, CONCURRENCY, READ_TIMEOUT, RUN_LIMIT)
        wall = time.monotonic() - start
        await killer  # every kill came while requests were running (each waits for its share to succeed first)
        state = await wait_until_idle(probe)
        after = await scrape(probe)
        health = (await probe.get("/health")).status_code
        again = await probe.post("/generate", json={"inputs": "def f():", "parameters": {"max_new_tokens": 4}})

    losses = [(r.call, reason) for r in results if (reason := lost(r)) is not None]
    hung_up = [r for r in results if r.hung_up]
    completed = len(results) - len(hung_up) - len(losses)
    # Non-streaming clients may hang up before the server has queued their request: it is then counted nowhere.
    unseen_at_most = sum(1 for r in hung_up if r.call.hang_up is HangUp.WHILE_WAITING)
    counts = {k: after_v - outcomes(before).get(k, 0.0) for k, after_v in outcomes(after).items()}
    preemptions = sample(after, "conveyor_preemptions_total") - sample(before, "conveyor_preemptions_total")
    restarts = sample(after, "conveyor_shard_restarts_total") - sample(before, "conveyor_shard_restarts_total")
    replayed = sample(after, "conveyor_requests_replayed_total") - sample(before, "conveyor_requests_replayed_total")
    print(
        f"\nsoak: sent={len(results)} completed={completed} cancelled={len(hung_up)} lost={len(losses)} "
        f"blocks_leaked={state.leaked} preemptions={preemptions:.0f} restarts_survived={restarts:.0f} "
        f"replayed={replayed:.0f} wall={wall:.1f}s "
        f"server_outcomes={ {k: int(v) for k, v in counts.items() if v} } "
        f"hang_ups={dict(Counter(r.call.hang_up.value for r in hung_up))} seed={SEED}"
    )

    assert not losses, f"{len(losses)} requests lost, the first: {losses[:3]}"
    assert state.idle, f"not idle after the soak: {state}"
    assert health == 200 and again.status_code == 200, again.text
    # Every request the server queued ends once, as a success or a cancellation; nothing else happened.
    assert {k: v for k, v in counts.items() if v and k not in ("success", "cancelled")} == {}
    assert len(results) - unseen_at_most <= counts["success"] + counts["cancelled"] <= len(results), counts
    # A client that hangs up after the last token went out is the server's success: the other way never.
    assert counts["success"] >= completed and counts["cancelled"] <= len(hung_up), counts
    assert preemptions > 0, "the KV pool was meant to be too small for the load"
    assert restarts == KILLS
