"""Overload: three times `--max-concurrent-requests` at once, streaming and not, on TGI's and OpenAI's routes.
Every request is answered 200 or 429 (a JSON error, never a hang or a dropped connection), the slots of the
admitted requests come back, and the deployment serves a full house again afterwards.

tests/e2e/test_lifecycle.py checks one refusal while two long streams hold a cap of 2; this is the burst.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from clients import (
    COMPLETIONS,
    GENERATE,
    GENERATE_STREAM,
    Call,
    HangUp,
    check,
    http_client,
    launch,
    outcomes,
    perform,
    scrape,
    wait_until,
    wait_until_idle,
)
from conftest import free_port, start_server

CAP = 8
# Streams are long enough to hold their slot until every request of the burst has been answered (the
# non-streaming ones are short), so at least STREAMS - CAP streams must be refused: a deterministic 429.
STREAMS, SHORT_CALLS = 3 * CAP // 2, 3 * CAP // 2
LONG, SHORT = 400, 8


def body(route: str, new_tokens: int, stream: bool) -> dict:
    if route == COMPLETIONS:
        return {"model": "m", "prompt": "def f(x):", "max_tokens": new_tokens, "ignore_eos": True, "stream": stream}
    return {"inputs": "def f(x):", "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, "details": True}}


def burst() -> list[Call]:
    """Half streams (held open at their 200, each closed or cancelled afterwards), half short requests, on both
    APIs, in a shuffled order of arrival."""
    streams = [
        Call(route, True, body(route, LONG, True), HangUp.BEFORE_FIRST_TOKEN, cancel=n % 4 < 2)
        for n, route in enumerate([GENERATE_STREAM, COMPLETIONS] * (STREAMS // 2))
    ]
    short = [Call(route, False, body(route, SHORT, False)) for route in [GENERATE, COMPLETIONS] * (SHORT_CALLS // 2)]
    calls = streams + short
    random.Random(3).shuffle(calls)
    return calls


def overloaded(status: int, payload: dict, route: str) -> bool:
    """A 429 in the route's own error shape, with Conveyor's `error_type` beside it."""
    if status != 429 or payload.get("error_type") != "overloaded":
        return False
    error = payload["error"]
    return error["type"] == "overloaded_error" if route == COMPLETIONS else isinstance(error, str) and bool(error)


async def test_three_times_the_cap_at_once_is_200_or_429_and_the_slots_come_back(tiny_model: Path) -> None:
    server = start_server(tiny_model, "--master-port", str(free_port()), "--max-concurrent-requests", str(CAP))
    try:
        hold = asyncio.Event()
        async with http_client(server.url, 4 * CAP) as client:
            before = outcomes(await scrape(client))
            started = [launch(client, call, hold=hold) for call in burst()]
            results = [r for r, _ in started]

            async def answered() -> bool:
                return all(r.status is not None or r.error is not None for r in results)

            await wait_until(answered, 120, "every request of the burst to be answered")
            hold.set()  # the admitted streams hang up now
            await asyncio.wait_for(asyncio.gather(*(task for _, task in started)), 60)

            assert [r.error for r in results if r.error] == []
            assert {r.status for r in results} <= {200, 429}, [(r.status, r.body) for r in results]
            refused = [r for r in results if r.status == 429]
            assert all(overloaded(r.status, r.body, r.call.route) for r in refused), [r.body for r in refused]
            admitted_streams = [r for r in results if r.status == 200 and r.call.stream]
            served = [r for r in results if r.status == 200 and not r.call.stream]
            assert [check(r) for r in served] == [None] * len(served)
            # A refusal needs CAP requests in flight, each of which was served. The streams held their slots to the
            # end, so at most CAP of them got in: at least STREAMS - CAP were refused.
            assert len(admitted_streams) + len(served) >= CAP
            assert len(admitted_streams) <= CAP and len(refused) >= STREAMS - CAP

            # The server counted each request once: served, refused, or cancelled by its client's hang-up; once
            # it has, every slot is free again.
            expected = {"success": len(served), "overloaded": len(refused), "cancelled": len(admitted_streams)}

            async def counted() -> bool:
                after = outcomes(await scrape(client))
                return {k: after[k] - before[k] for k in expected} == expected

            await wait_until(counted, 60, f"the server to count {expected}")
            state = await wait_until_idle(client)
            assert state.idle, state
            assert (await client.get("/health")).status_code == 200
            # A full house again: CAP requests at once, streaming and not, every one served.
            again = [Call(c.route, c.stream, body(c.route, SHORT, c.stream)) for c in burst()[:CAP]]
            results = await asyncio.gather(*(perform(client, call) for call in again))
            assert [check(r) for r in results] == [None] * CAP
        assert server.stop() == 0
    finally:
        server.stop()
