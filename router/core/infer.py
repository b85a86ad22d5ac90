"""From a validated request to a stream of events, with the admission limit every front end shares."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from conveyor import tracing
from conveyor.keys import ANONYMOUS, ApiKey
from conveyor.router.core.events import ErrorEvent, Event, Finished, PooledEvent, ScoredToken, TokenEvent
from conveyor.router.core.groups import Groups
from conveyor.router.core.live_stats import LiveStats
from conveyor.router.core.sequence import Sequence
from conveyor.router.metrics import Metrics
from conveyor.router.pipeline.request import ValidRequest


class OverloadedError(RuntimeError):
    """More requests are in flight than `max_concurrent_requests`: refused at once, never queued."""


class GenerationError(RuntimeError):
    """The request failed in the shards (more often than --max-request-retries)."""


class UnavailableError(RuntimeError):
    """The server stopped before the request could finish."""


class RequestCancelled(RuntimeError):
    """Someone cancelled the request by its id (`DELETE /v1/requests/{id}`) before it finished."""


_ERRORS = {"unavailable": UnavailableError, "cancelled": RequestCancelled}


@dataclass
class Answer:
    """A whole generation, for the non-streaming routes."""

    events: list[TokenEvent] = field(default_factory=list)
    prefill: tuple[ScoredToken, ...] = ()

    @property
    def tokens(self) -> list[ScoredToken]:
        return [e.token for e in self.events]

    @property
    def finished(self) -> Finished:
        """How the generation ended (a stream always ends with a finished event or an error)."""
        finished = self.events[-1].finished
        assert finished is not None
        return finished


class Infer:
    def __init__(self, groups: Groups, max_concurrent_requests: int, metrics: Metrics) -> None:
        self.groups = groups  # every shard group, and the placement that puts each request on one
        self.adapters = groups.adapters
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics = metrics
        self.sequences: dict[int, Sequence] = {}  # every request queued or running, by its sequence id
        self.live = LiveStats()  # the last minute's tokens and latencies, for the dashboard

    @property
    def in_flight(self) -> int:
        return len(self.sequences)

    @asynccontextmanager
    async def stream(
        self, request: ValidRequest, key: ApiKey = ANONYMOUS, request_id: str = ""
    ) -> AsyncIterator[AsyncIterator[Event]]:
        """Queues the request, made with `key` and named `request_id` by its caller, and yields its events;
        leaving the block early cancels it.

        The slot is taken here, before anything is awaited, so the 429 answer is immediate.
        """
        self.admit(key, 1)
        adapter = request.parameters.adapter
        self.adapters.acquire(adapter)  # an adapter unloaded since validation: 404 here, before anything is queued
        if adapter is not None:
            self.metrics.adapter_requests.labels(adapter).inc()
        if request.parameters.grammar is not None:
            self.metrics.constrained_requests.labels(request.parameters.grammar.kind).inc()
        if (priority := key.priority(request.parameters.priority)) != request.parameters.priority:
            request = replace(request, parameters=replace(request.parameters, priority=priority))
        sequence = Sequence(
            id=self.groups.new_request_id(),
            request=request,
            key=key,
            request_id=request_id,
            span=trace.get_current_span(),
        )
        sequence.queue_span = tracing.tracer().start_span("queue", context=trace.set_span_in_context(sequence.span))
        self.sequences[sequence.id] = sequence
        self.metrics.key_in_flight.labels(key.name).inc()
        try:
            self.groups.submit(sequence)
            yield _events(sequence, self.metrics, self.live)
        finally:
            if not sequence.is_finished:
                sequence.cancelled = True  # the scheduler filters it out at its next step
                self._count("cancelled", key)
            if sequence.queue_span.is_recording():
                sequence.queue_span.end()  # left before it was ever batched
            del self.sequences[sequence.id]
            self.metrics.key_in_flight.labels(key.name).dec()
            self.adapters.release(adapter)

    def admit(self, key: ApiKey, count: int) -> None:
        """Refuses (429) `count` requests together unless the server's limit and the key's cap have room for all,
        saying which: the choices of one `n > 1` request start together or not at all."""
        if self.in_flight + count > self.max_concurrent_requests:
            self._count("overloaded", key)
            raise OverloadedError(
                f"Model is overloaded: {self.in_flight} requests in flight, the server's cap "
                f"(--max-concurrent-requests {self.max_concurrent_requests})"
            )
        if key.max_concurrent is not None and (held := len(self.of_key(key))) + count > key.max_concurrent:
            self._count("overloaded", key)
            raise OverloadedError(
                f"API key {key.name!r} has {held} requests in flight and asked for {count} more, past its cap "
                f"(max_concurrent {key.max_concurrent})"
            )

    def _count(self, outcome: str, key: ApiKey) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.metrics.key_requests.labels(key.name, outcome).inc()

    def of_key(self, key: ApiKey) -> list[Sequence]:
        """The requests in flight made with `key`."""
        return [s for s in self.sequences.values() if s.key.name == key.name]

    def of(self, caller: ApiKey) -> list[Sequence]:
        """The requests in flight that `caller` may see and cancel, oldest first."""
        return [s for s in self.sequences.values() if caller.may_manage(s.key)]

    def cancel(self, request_id: str, caller: ApiKey) -> list[Sequence]:
        """Ends the requests in flight named `request_id` that `caller` may cancel, with a `cancelled` error
        event; a waiting one never runs, a running one leaves the batch (and its blocks) at the next step."""
        cancelled = [s for s in self.of(caller) if s.request_id == request_id and not s.is_finished]
        for sequence in cancelled:
            # Not by whom: an ordinary key's client must not learn the names of the admin keys.
            sequence.fail(f"request {request_id} was cancelled", "cancelled")
            sequence.cancelled = True
        return cancelled

    async def pool(self, request: ValidRequest, key: ApiKey = ANONYMOUS, request_id: str = "") -> PooledEvent:
        """A prompt-only request's answer (embeddings, rerank), queued and stepped as any request is."""
        async with self.stream(request, key, request_id) as events:
            async for event in events:
                if isinstance(event, ErrorEvent):
                    raise _ERRORS.get(event.error_type, GenerationError)(event.message)
                if isinstance(event, PooledEvent):
                    return event
        raise GenerationError("the request ended without its answer")

    async def generate(self, request: ValidRequest, key: ApiKey = ANONYMOUS, request_id: str = "") -> Answer:
        response = Answer()
        async with self.stream(request, key, request_id) as events:
            async for event in events:
                if isinstance(event, ErrorEvent):
                    raise _ERRORS.get(event.error_type, GenerationError)(event.message)
                if event.prefill:
                    response.prefill = event.prefill
                response.events.append(event)
        return response


async def _events(sequence: Sequence, metrics: Metrics, live: LiveStats) -> AsyncIterator[Event]:
    """The sequence's events as they arrive, timed: first token, gaps between tokens, whole request."""
    last: float | None = None
    first = time.monotonic()
    key = sequence.key.name
    key_tokens = metrics.key_generated_tokens.labels(key)  # looked up once, not per token
    adapter = sequence.request.parameters.adapter
    adapter_tokens = metrics.adapter_generated_tokens.labels(adapter) if adapter is not None else None
    while True:
        event = await sequence.events.get()
        now = time.monotonic()
        if isinstance(event, ErrorEvent):
            metrics.requests.labels(event.error_type).inc()
            metrics.key_requests.labels(key, event.error_type).inc()
            yield event
            return
        if isinstance(event, PooledEvent):  # a prompt-only request's one event: no token was generated
            metrics.requests.labels("success").inc()
            metrics.key_requests.labels(key, "success").inc()
            metrics.duration.observe(now - sequence.queued_at)
            prompt = sequence.num_prompt_tokens
            metrics.tgi.finished(prompt, 0, 0, event.cached_tokens, now, sequence.batched_at, now)
            yield event
            return
        metrics.generated_tokens.inc()
        key_tokens.inc()
        if adapter_tokens is not None:
            adapter_tokens.inc()
        if last is None:
            first = now
            metrics.ttft.observe(now - sequence.queued_at)
            live.first_token(now, now - sequence.queued_at)
        else:
            metrics.itl.observe(now - last)
            live.next_token(now, now - last)
        last = now
        if event.finished is not None:
            metrics.requests.labels("success").inc()
            metrics.key_requests.labels(key, "success").inc()
            metrics.duration.observe(now - sequence.queued_at)
            metrics.tgi.finished(
                sequence.num_prompt_tokens,
                len(sequence.generated_ids),
                sequence.max_new_tokens,
                sequence.cached_prompt_tokens,
                first,
                sequence.batched_at,
                now,
            )
        yield event
        if event.finished is not None:
            return
