"""From a validated request to a stream of events, with the admission limit every front end shares."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from conveyor.router.events import ErrorEvent, Event, Finished, Token, TokenEvent
from conveyor.router.metrics import Metrics
from conveyor.router.request import ValidRequest
from conveyor.router.scheduler import Scheduler
from conveyor.router.sequence import Sequence
from opentelemetry import trace

from conveyor import tracing


class OverloadedError(RuntimeError):
    """More requests are in flight than `max_concurrent_requests`: refused at once, never queued."""


class GenerationError(RuntimeError):
    """The request failed in the shards (more often than --max-request-retries)."""


class UnavailableError(RuntimeError):
    """The server stopped before the request could finish."""


@dataclass
class Response:
    """A whole generation, for the non-streaming routes."""

    events: list[TokenEvent] = field(default_factory=list)
    prefill: tuple[Token, ...] = ()

    @property
    def tokens(self) -> list[Token]:
        return [e.token for e in self.events]

    @property
    def finished(self) -> Finished:
        """How the generation ended (a stream always ends with a finished event or an error)."""
        finished = self.events[-1].finished
        assert finished is not None
        return finished


class Infer:
    def __init__(self, scheduler: Scheduler, max_concurrent_requests: int, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.max_concurrent_requests = max_concurrent_requests
        self.metrics = metrics
        self.in_flight = 0

    @asynccontextmanager
    async def stream(self, request: ValidRequest) -> AsyncIterator[AsyncIterator[Event]]:
        """Queues the request and yields its events; leaving the block early cancels it.

        The slot is taken here, before anything is awaited, so the 429 answer is immediate.
        """
        if self.in_flight >= self.max_concurrent_requests:
            self.metrics.requests.labels("overloaded").inc()
            raise OverloadedError("Model is overloaded")
        self.in_flight += 1
        if request.parameters.grammar is not None:
            self.metrics.constrained_requests.labels(request.parameters.grammar.kind).inc()
        sequence = Sequence(id=self.scheduler.new_request_id(), request=request, span=trace.get_current_span())
        sequence.queue_span = tracing.tracer().start_span("queue", context=trace.set_span_in_context(sequence.span))
        try:
            self.scheduler.submit(sequence)
            yield _events(sequence, self.metrics)
        finally:
            if not sequence.is_finished:
                sequence.cancelled = True  # the scheduler filters it out at its next step
                self.metrics.requests.labels("cancelled").inc()
            if sequence.queue_span.is_recording():
                sequence.queue_span.end()  # left before it was ever batched
            self.in_flight -= 1

    async def generate(self, request: ValidRequest) -> Response:
        response = Response()
        async with self.stream(request) as events:
            async for event in events:
                if isinstance(event, ErrorEvent):
                    kind = UnavailableError if event.error_type == "unavailable" else GenerationError
                    raise kind(event.message)
                if event.prefill:
                    response.prefill = event.prefill
                response.events.append(event)
        return response


async def _events(sequence: Sequence, metrics: Metrics) -> AsyncIterator[Event]:
    """The sequence's events as they arrive, timed: first token, gaps between tokens, whole request."""
    last: float | None = None
    while True:
        event = await sequence.events.get()
        now = time.monotonic()
        if isinstance(event, ErrorEvent):
            metrics.requests.labels(event.error_type).inc()
            yield event
            return
        metrics.generated_tokens.inc()
        if last is None:
            metrics.ttft.observe(now - sequence.queued_at)
        else:
            metrics.itl.observe(now - last)
        last = now
        if event.finished is not None:
            metrics.requests.labels("success").inc()
            metrics.duration.observe(now - sequence.queued_at)
        yield event
        if event.finished is not None:
            return
