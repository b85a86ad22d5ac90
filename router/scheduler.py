"""The batching loop: one task owns the running batch and every prefill/decode decision.

`Scheduler` holds what every loop shares: after every step each token goes to its request's stream at once,
and requests that finished, or whose client went away, are filtered out of the batch on the shards so that
their KV memory is freed before the next step. `PaddedScheduler` is TGI's loop for the padded engine: between
two decode steps it asks the policy whether queued requests may join, pausing the running batch for their
prefill. The paged engine's loop, which mixes prompt chunks into decode steps, is in `paged_scheduler.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from contextlib import contextmanager
from typing import Awaitable, Iterable, Iterator

from conveyor import tracing
from conveyor.router.shard_client import ShardedClient, ShardError, StepResult
from conveyor.router.events import ErrorEvent, events_from_generation
from conveyor.router.metrics import Metrics
from conveyor.router.policy import BatchingConfig, admission_when_idle, admission_when_running
from conveyor.router.queue import Entry, NextBatch, Queue
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)


def request_pb(entry: Entry) -> pb.Request:
    """The request as a shard gets it: a resumed one (after a preemption) brings the tokens it generated."""
    p = entry.request.parameters
    return pb.Request(
        id=entry.id,
        input_ids=entry.tokens,
        resumed_tokens=len(entry.generated_ids),
        parameters=pb.SamplingParameters(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            typical_p=p.typical_p,
            do_sample=p.sampling,
            seed=p.seed or 0,
            repetition_penalty=p.repetition_penalty,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
        ),
        stopping_parameters=pb.StoppingParameters(
            max_new_tokens=p.max_new_tokens, stop_sequences=p.stop, ignore_eos_token=p.ignore_eos
        ),
        prefill_logprobs=p.decoder_input_details and not entry.generated_ids,
        top_n_tokens=p.top_n_tokens,
        blocks=entry.blocks,
    )


class Scheduler:
    def __init__(self, client: ShardedClient, metrics: Metrics) -> None:
        self.client = client
        self.metrics = metrics
        self.queue = Queue()
        self.running: dict[int, Entry] = {}
        self.healthy = True
        self._wakeup = asyncio.Event()
        self._request_ids = itertools.count()
        self._batch_ids = itertools.count()

    def submit(self, entry: Entry) -> None:
        self.queue.append(entry)
        self.metrics.queue_size.set(len(self.queue))
        self._wakeup.set()

    def new_request_id(self) -> int:
        return next(self._request_ids)

    async def run(self) -> None:
        raise NotImplementedError

    @property
    def allocator(self):
        """The paged engine's KV blocks (for /info and metrics); None for the padded engine."""
        return None

    def describe(self) -> dict:
        """What /info shows of the batching policy."""
        return {}

    def _release(self, entry: Entry) -> None:
        """Gives back whatever KV the request held (the paged engine's blocks)."""

    def _join(self, entries: Iterable[Entry]) -> None:
        """Requests enter the running set; their wait in the queue ends the first time (not when a preempted
        request comes back)."""
        now = time.monotonic()
        for entry in entries:
            self.running[entry.id] = entry
            if entry.batched_at is None:
                entry.batched_at = now
                entry.queue_span.end()
                self.metrics.queue_time.observe(now - entry.queued_at)
                self.metrics.prompt_tokens.inc(entry.input_length)

    @contextmanager
    def _step_span(self, method: str, batches: list[pb.CachedBatch]) -> Iterator[list[tuple[str, str]]]:
        """A span for one step, in the trace of its first request and linked to every other one; yields the
        gRPC metadata that carries it to the shards."""
        spans = [e.span for b in batches for r in b.request_ids if (e := self.running.get(r)) and e.span]
        with tracing.span(method, spans[0] if spans else None, links=spans[1:], batch_size=len(spans)) as span:
            yield tracing.inject(span)

    async def _step(
        self, batches: list[pb.CachedBatch], call: Awaitable[StepResult], method: str
    ) -> pb.CachedBatch | None:
        """Awaits one RPC over `batches`, streams its tokens, and filters out requests that are over."""
        try:
            return await self._run_step(batches, call, method)
        finally:
            self._update_gauges()

    async def _run_step(
        self, batches: list[pb.CachedBatch], call: Awaitable[StepResult], method: str
    ) -> pb.CachedBatch | None:
        try:
            with self.metrics.step.labels(method).time():
                result = await call
        except ShardError as exc:
            await self._fail(batches, str(exc))
            return None
        self.healthy = True
        self.metrics.shard_step.observe(result.timings.total_ns / 1e9)
        self._stepped(result)
        self._send(result)
        if result.batch is None:
            self._forget(r for b in batches for r in b.request_ids)
            return None
        try:
            return await self._filter(result.batch)
        except ShardError as exc:
            await self._fail([result.batch], str(exc))
            return None

    def _stepped(self, result: StepResult) -> None:
        """Hook: the step ran on every shard, before its tokens are sent."""

    def _update_gauges(self) -> None:
        self.metrics.queue_size.set(len(self.queue))
        self.metrics.batch_size.set(len(self.running))
        if self.allocator is not None:
            self.metrics.kv_blocks_total.set(self.allocator.num_blocks)
            self.metrics.kv_blocks_used.set(self.allocator.num_blocks - self.allocator.free_blocks)

    def _send(self, result: StepResult) -> None:
        for generation in result.generations:
            entry = self.running.get(generation.request_id)
            if entry is None or entry.cancelled:
                continue
            entry.generated_ids.extend(generation.tokens.ids)
            for event in events_from_generation(generation):
                entry.events.put_nowait(event)
                if event.finished is not None:
                    entry.done = True

    async def _filter(self, batch: pb.CachedBatch) -> pb.CachedBatch | None:
        """Keeps on the shards only the requests that still have a listener and tokens to generate."""
        keep = [r for r in batch.request_ids if self._alive(r)]
        self._forget(r for r in batch.request_ids if r not in set(keep))
        return await self._keep(batch, keep)

    async def _keep(self, batch: pb.CachedBatch, keep: list[int]) -> pb.CachedBatch | None:
        if len(keep) == len(batch.request_ids):
            return batch
        if not keep:
            await self.client.clear_cache(batch.id)
            return None
        return await self.client.filter_batch(batch.id, keep)

    def _alive(self, request_id: int) -> bool:
        entry = self.running.get(request_id)
        return entry is not None and not entry.done and not entry.cancelled

    def _forget(self, request_ids: Iterable[int]) -> list[Entry]:
        """Takes requests out of the running set and gives their KV blocks back."""
        gone = []
        for request_id in list(request_ids):
            if (entry := self.running.pop(request_id, None)) is not None:
                self._release(entry)
                gone.append(entry)
        return gone

    async def _fail(self, batches: list[pb.CachedBatch], message: str) -> None:
        """A failed step fails every request in it; the shards drop those batches if they still can."""
        log.error("generation step failed", extra={"error": message})
        self.healthy = False
        for entry in self._forget(r for b in batches for r in b.request_ids):
            if not entry.done:
                entry.done = True
                entry.events.put_nowait(ErrorEvent(message, "generation"))
        for batch in batches:
            try:
                await self.client.clear_cache(batch.id)
            except ShardError:
                pass


class PaddedScheduler(Scheduler):
    """TGI's loop: prefill what the policy admits, pausing the running batch, then decode everything."""

    def __init__(self, client: ShardedClient, config: BatchingConfig, metrics: Metrics) -> None:
        super().__init__(client, metrics)
        self.config = config

    def describe(self) -> dict:
        return {"scheduling": "continuous", "prefix_caching": False, "chunked_prefill": False}

    async def run(self) -> None:
        """Runs for ever: wait for work, prefill it, decode until the batch empties, admitting newcomers."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while (new := self.queue.next_batch(admission_when_idle(self.config))) is not None:
                cached = await self._prefill(new)
                await self._decode_loop(cached)

    async def _decode_loop(self, cached: pb.CachedBatch | None) -> None:
        waiting_steps = 1
        while cached is not None:
            batches = [cached]
            admission = admission_when_running(self.config, cached.size, cached.max_tokens, waiting_steps)
            if (new := self.queue.next_batch(admission)) is not None:
                log.debug("pausing the running batch for a prefill", extra={"joining": len(new.entries)})
                if (joined := await self._prefill(new)) is not None:
                    batches.append(joined)
                waiting_steps = 1
            with self._step_span("decode", batches) as metadata:
                cached = await self._step(batches, self.client.decode(batches, metadata), "decode")
            waiting_steps += 1

    async def _prefill(self, new: NextBatch) -> pb.CachedBatch | None:
        self._join(new.entries)
        batch = pb.Batch(
            id=next(self._batch_ids),
            requests=[request_pb(e) for e in new.entries],
            size=len(new.entries),
            max_tokens=new.max_tokens,
        )
        ids = [e.id for e in new.entries]
        cached = pb.CachedBatch(id=batch.id, request_ids=ids, size=len(ids))
        with self._step_span("prefill", [cached]) as metadata:
            return await self._step([cached], self.client.prefill(batch, metadata), "prefill")
