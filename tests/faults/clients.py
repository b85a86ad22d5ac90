"""Clients for the fault tests (soak, overload, shutdown): HTTP requests of every generating route, read to
their end as a careful client would and checked, or given up on at a chosen point as an impatient one would.

`perform` runs one `Call` and returns its `Result`; `check` says what is wrong with a result that was read to
its end (None when nothing is): status 200, one final event that ends the stream, nothing after it, tokens
counted consistently. The server-side view (`/metrics`, `/info`) comes from `scrape` and `wait_until_idle`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

GENERATE, GENERATE_STREAM, COMPLETIONS = "/generate", "/generate_stream", "/v1/completions"
# Every route that queues a generation, with a small valid body (the drain must refuse each of them).
GENERATING_ROUTES = {
    "/generate": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "m", "prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
}
TGI_FINISH_REASONS = {"length", "eos_token", "stop_sequence"}
OPENAI_FINISH_REASONS = {"length", "stop"}
WORDS = (
    "def class return self import from if else for while in not and or None True False lambda yield with as try "
    "except raise pass print range len list dict str int x y i n value key item data result queue 0 1 2 10 = == "
    "+ - ( ) [ ] : , . # async await"
).split()


class HangUp(Enum):
    """Where an impatient client goes away. Streams: once their 200 came (the server has queued the request)
    but before any token, after the first token, or after a few tokens. A non-streaming client cannot see
    tokens: it gives up while it waits, once the other streams of the run have received a few tokens."""

    BEFORE_FIRST_TOKEN = "before first token"
    AFTER_FIRST_TOKEN = "after first token"
    MID_STREAM = "mid-stream"
    WHILE_WAITING = "while waiting"


@dataclass(frozen=True)
class Call:
    route: str
    stream: bool
    body: dict
    hang_up: HangUp | None = None
    after_tokens: int = 0  # MID_STREAM: tokens read first; WHILE_WAITING: tokens the other streams get first
    cancel: bool = False  # hang up by cancelling the client's task (else: by closing the response)

    @property
    def max_new_tokens(self) -> int:
        return self.body["max_tokens"] if self.route == COMPLETIONS else self.body["parameters"]["max_new_tokens"]

    @property
    def include_usage(self) -> bool:
        return bool(self.body.get("stream_options", {}).get("include_usage"))


@dataclass
class Result:
    call: Call
    status: int | None = None
    body: Any = None  # the JSON answer of a non-streaming call, or of a refused stream
    events: list[Any] = field(default_factory=list)  # a stream's `data:` payloads as they arrive: JSON or "[DONE]"
    hung_up: bool = False  # the client went away before it had read the whole answer
    error: str | None = None  # the client's own failure: timeout, broken connection, malformed event

    @property
    def tokens(self) -> int:
        """Token events received so far."""
        return sum(1 for e in self.events if _is_token(e))


class TokenClock:
    """Counts the tokens every stream of a run has received, so a non-streaming client can give up 'a few tokens
    from now' without any clock."""

    def __init__(self) -> None:
        self.count = 0
        self._tick = asyncio.Event()

    def tick(self) -> None:
        self.count += 1
        self._tick.set()
        self._tick = asyncio.Event()

    async def passed(self, n: int) -> None:
        target = self.count + n
        while self.count < target:
            await self._tick.wait()


class _ProtocolError(Exception):
    pass


async def _sse(response: httpx.Response):
    """The `data:` payloads of a server-sent event stream, one per event; an event cut off before its blank
    line is an error, not an event."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line.startswith((":", "event:", "id:", "retry:")):
            raise _ProtocolError(f"not an SSE line: {line!r}")
    if data:
        raise _ProtocolError(f"the stream ended inside an event: {data!r}")


def _payload(data: str) -> Any:
    return data if data == "[DONE]" else json.loads(data)


def _is_token(payload: Any) -> bool:
    return isinstance(payload, dict) and ("token" in payload or bool(payload.get("choices")))


async def _read(
    client: httpx.AsyncClient,
    call: Call,
    result: Result,
    clock: TokenClock,
    reached: asyncio.Event,
    hold: asyncio.Event | None,
) -> None:
    """Makes the call and reads its answer into `result`. At the call's hang-up point it waits for `hold` if
    given (keeping its request in flight), then goes away: returns with the response unread, which closes the
    connection, or sets `reached` and waits to be cancelled."""

    async def hang_up() -> bool:
        if hold is not None:
            await hold.wait()
        if call.cancel:
            reached.set()
            await asyncio.Future()  # cancelled by `perform`
        result.hung_up = True
        return True

    try:
        if not call.stream:
            response = await client.post(call.route, json=call.body)
            result.status = response.status_code
            result.body = response.json()
            return
        async with client.stream("POST", call.route, json=call.body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.body = json.loads(await response.aread())
                return
            if call.hang_up is HangUp.BEFORE_FIRST_TOKEN and await hang_up():
                return
            async for data in _sse(response):
                result.events.append(_payload(data))
                if not _is_token(result.events[-1]):
                    continue
                clock.tick()
                if call.hang_up is HangUp.AFTER_FIRST_TOKEN and result.tokens == 1 and await hang_up():
                    return
                if call.hang_up is HangUp.MID_STREAM and result.tokens == call.after_tokens and await hang_up():
                    return
    except (httpx.HTTPError, _ProtocolError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"


def launch(
    client: httpx.AsyncClient, call: Call, clock: TokenClock | None = None, hold: asyncio.Event | None = None
) -> tuple[Result, asyncio.Task[Result]]:
    """Starts one call; its `Result` fills in as the answer arrives (a test can wait on it), and the task
    returns it once the call is read to its end or hung up. A client that hangs up by cancelling has its
    reading task cancelled, as an application abandoning a request would."""
    result, clock, reached = Result(call), clock or TokenClock(), asyncio.Event()

    async def run() -> Result:
        reader = asyncio.create_task(_read(client, call, result, clock, reached, hold))
        if call.hang_up is None or not call.cancel:
            await reader
            return result
        if call.hang_up is HangUp.WHILE_WAITING:
            trigger = asyncio.create_task(clock.passed(call.after_tokens))
        else:
            trigger = asyncio.create_task(reached.wait())
        try:
            done, _ = await asyncio.wait({reader, trigger}, return_when=asyncio.FIRST_COMPLETED)
            if reader not in done:
                reader.cancel()
                with suppress(asyncio.CancelledError):
                    await reader
                result.hung_up = True
        finally:
            trigger.cancel()
            reader.cancel()
        return result

    return result, asyncio.create_task(run())


async def perform(client: httpx.AsyncClient, call: Call, clock: TokenClock | None = None) -> Result:
    return await launch(client, call, clock)[1]


def http_client(url: str, connections: int, timeout: float = 120.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


async def perform_all(
    url: str, calls: list[Call], concurrency: int, timeout: float = 120.0, limit: float | None = None
) -> list[Result]:
    """Every call, at most `concurrency` at once, over one connection pool; `timeout` bounds each read, `limit`
    the whole run."""
    clock = TokenClock()
    gate = asyncio.Semaphore(concurrency)
    async with http_client(url, concurrency, timeout) as client:

        async def one(call: Call) -> Result:
            async with gate:
                return await perform(client, call, clock)

        return await asyncio.wait_for(asyncio.gather(*(one(c) for c in calls)), limit)


# --- what a finished call must look like ---------------------------------------------------------------------


def check(result: Result) -> str | None:
    """What is wrong with a call that was read to its end, or None."""
    call = result.call
    if result.error is not None:
        return result.error
    if result.status != 200:
        return f"status {result.status}: {result.body}"
    if call.route == COMPLETIONS:
        return _check_completion_stream(result) if call.stream else _check_completion(result.body, call)
    return _check_generate_stream(result) if call.stream else _check_generate(result.body, call)


def _check_length(call: Call, generated: int, finish_reason: str, reasons: set[str]) -> str | None:
    if finish_reason not in reasons:
        return f"finish_reason {finish_reason!r}"
    # An EOS or stop sequence may come on the last allowed token; running out of tokens needs all of them.
    if not 1 <= generated <= call.max_new_tokens or (finish_reason == "length" and generated != call.max_new_tokens):
        return f"{generated} tokens generated for max {call.max_new_tokens}, finish_reason {finish_reason!r}"
    return None


def _check_generate(body: dict, call: Call) -> str | None:
    if not isinstance(body.get("generated_text"), str):
        return f"no generated_text: {body}"
    details = body["details"]
    if len(details["tokens"]) != details["generated_tokens"]:
        return f"{len(details['tokens'])} tokens in details for generated_tokens {details['generated_tokens']}"
    return _check_length(call, details["generated_tokens"], details["finish_reason"], TGI_FINISH_REASONS)


def _check_generate_stream(result: Result) -> str | None:
    events = result.events
    if any(not isinstance(e, dict) or "error" in e or "token" not in e for e in events):
        return f"not a token event: {next(e for e in events if not isinstance(e, dict) or 'token' not in e)}"
    if [e["index"] for e in events] != list(range(1, len(events) + 1)):
        return f"indices {[e['index'] for e in events]}"  # a token repeated or skipped
    finals = [n for n, e in enumerate(events) if e["generated_text"] is not None]
    if finals != [len(events) - 1]:
        return f"final events at {finals} of {len(events)}"  # none, several, or events after it
    details = events[-1]["details"]
    if details["generated_tokens"] != len(events):
        return f"{len(events)} events for generated_tokens {details['generated_tokens']}"
    return _check_length(result.call, len(events), details["finish_reason"], TGI_FINISH_REASONS)


def _check_completion(body: dict, call: Call) -> str | None:
    (choice,) = body["choices"]
    if not isinstance(choice.get("text"), str):
        return f"no text: {body}"
    return _check_length(call, body["usage"]["completion_tokens"], choice["finish_reason"], OPENAI_FINISH_REASONS)


def _check_completion_stream(result: Result) -> str | None:
    events = result.events
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        return f"the stream does not end with one [DONE]: {events[-3:]}"
    chunks = events[:-1]
    if any("error" in c for c in chunks):
        return f"error event: {next(c for c in chunks if 'error' in c)}"
    usage = [c for c in chunks if not c["choices"]]
    tokens = [c for c in chunks if c["choices"]]
    finals = [n for n, c in enumerate(tokens) if c["choices"][0]["finish_reason"] is not None]
    if finals != [len(tokens) - 1]:
        return f"finish_reason set on chunks {finals} of {len(tokens)}"
    if result.call.include_usage:
        if len(usage) != 1 or chunks[-1] is not usage[0] or usage[0]["usage"]["completion_tokens"] != len(tokens):
            return f"usage chunks {usage} for {len(tokens)} tokens"
    elif usage:
        return f"usage chunks not asked for: {usage}"
    return _check_length(result.call, len(tokens), tokens[-1]["choices"][0]["finish_reason"], OPENAI_FINISH_REASONS)


def check_error_event(result: Result, error_type: str) -> str | None:
    """A stream that was ended by the server: its last event is `{"error", "error_type"}` and nothing follows."""
    if result.error is not None or result.status != 200 or not result.events:
        return f"error {result.error}, status {result.status}, {len(result.events)} events"
    last = result.events[-1]
    if result.call.route == COMPLETIONS and last == "[DONE]":
        return "the stream ended with [DONE]"
    if not isinstance(last, dict) or "error" not in last or last.get("error_type") != error_type:
        return f"last event {last!r}"
    if any(isinstance(e, dict) and "error" in e for e in result.events[:-1]):
        return "an error event before the last"
    return None


# --- random calls --------------------------------------------------------------------------------------------


def random_prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def random_call(rng: random.Random, hang_up_share: float, max_words: int = 24, max_new_tokens: int = 64) -> Call:
    """/generate, /generate_stream or /v1/completions (streaming or not), greedy or sampled (seeded or not);
    with probability `hang_up_share` the client hangs up at a random point."""
    route, stream = rng.choice([(GENERATE, False), (GENERATE_STREAM, True), (COMPLETIONS, False), (COMPLETIONS, True)])
    prompt, new_tokens = random_prompt(rng, max_words), rng.randint(1, max_new_tokens)
    sampling: dict[str, Any] = rng.choice([{}, {"temperature": 0.8}, {"temperature": 0.7, "seed": rng.randrange(1000)}])
    if route == COMPLETIONS:
        body: dict[str, Any] = {"model": "conveyor", "prompt": prompt, "max_tokens": new_tokens, "stream": stream}
        body.update(sampling or {"temperature": 0})
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    else:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True, **sampling}}
    if rng.random() >= hang_up_share:
        return Call(route, stream, body)
    if not stream:
        # Most give up mid-generation (a few hundred tokens stream by while a request waits); some even before
        # their request was read.
        return Call(route, stream, body, HangUp.WHILE_WAITING, after_tokens=rng.randint(0, 150), cancel=True)
    hang_up = rng.choice([HangUp.BEFORE_FIRST_TOKEN, HangUp.AFTER_FIRST_TOKEN, HangUp.MID_STREAM])
    return Call(route, stream, body, hang_up, after_tokens=rng.randint(2, 16), cancel=rng.random() < 0.5)


# --- the server's view ---------------------------------------------------------------------------------------


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = (await client.get("/metrics")).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def outcomes(samples: dict) -> dict[str, float]:
    """conveyor_requests_total by outcome."""
    return {dict(labels)["outcome"]: v for (name, labels), v in samples.items() if name == "conveyor_requests_total"}


async def wait_until(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    """The async `conftest.wait_for`: polls `condition` until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


@dataclass
class Idle:
    kv_blocks_total: int
    kv_blocks_free: int
    queue_size: float
    batch_size: float

    @property
    def leaked(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def idle(self) -> bool:
        return self.leaked == 0 and self.queue_size == 0 and self.batch_size == 0


async def idle_state(client: httpx.AsyncClient) -> Idle:
    info, samples = (await client.get("/info")).json(), await scrape(client)
    return Idle(
        info["kv_blocks_total"],
        info["kv_blocks_free"],
        sample(samples, "conveyor_queue_size"),
        sample(samples, "conveyor_batch_current_size"),
    )


async def wait_until_idle(client: httpx.AsyncClient, timeout: float = 60.0) -> Idle:
    """Waits until every KV block is free and the queue and the batch are empty; returns what it last saw
    (a test asserts on it, so a leak shows its numbers rather than a timeout)."""
    state = await idle_state(client)
    deadline = time.monotonic() + timeout
    while not state.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        state = await idle_state(client)
    return state
