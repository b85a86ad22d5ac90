"""The shard's gRPC service: cached batches by id, and the engine behind them.

`Prefill` and `Decode` are the same step: the cached batches named (the running one, with this step's
`updates`), joined by the new requests of a `Prefill`, run one `Engine.step`. A `DecodeRun` is up to `max_steps`
Decodes in one call: each next step starts as soon as the last one's answer is sent.

Forwards run on the shard's torch thread (`torch_thread.py`: the thread that loaded the model; torch releases the
GIL), so the event loop keeps answering `Health` while a long prefill runs, and batches are only ever touched by
that one thread. So do `LoadAdapter` and `UnloadAdapter`, between steps; a LoRA adapter named by a Hub id is
downloaded first, on a thread of its own, so that steps go on meanwhile. The standard health service beside it
answers what shard/service/health_report.py reports; the fault tests' failpoints are in
shard/service/failpoints.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from opentelemetry.trace import SpanKind

from conveyor import tracing
from conveyor.shard.adapters.adapter_files import AdapterError, read_timeout, resolve_source
from conveyor.shard.batch.request_state import BadRequest
from conveyor.shard.batch.running_batch import RunningBatch
from conveyor.shard.service import failpoints
from conveyor.shard.service.health_report import HealthReport
from conveyor.shard.service.torch_thread import TorchThread
from conveyor.shard.service.watchdog import StepWatch, step_timeout
from conveyor.shard.step import step_timing
from conveyor.shard.step.engine import Engine, StepOutput
from conveyor.shard_channels import CHANNEL_OPTIONS, Security
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def rpc(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turns any exception of a handler into a gRPC error carrying its message, and keeps the shard serving."""

    @functools.wraps(handler)
    async def wrapper(self: ShardService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parent = tracing.extract(dict(context.invocation_metadata() or ()))
        try:
            with tracing.span(f"shard.{handler.__name__}", parent, kind=SpanKind.SERVER):
                return await handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the message goes back to the router
            await context.abort(*_status(handler.__name__, exc))

    return wrapper


def _status(name: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a failed RPC (or step message) answers: a refused request is the caller's error; anything
    else is logged here and named by its type."""
    if isinstance(exc, BadRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("rpc failed", extra={"rpc": name})
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ShardService(pb_grpc.ShardServicer):
    def __init__(self, engine: Engine, urls: list[str], torch_thread: TorchThread) -> None:
        self.engine = engine
        self.urls = urls
        self.cache: dict[int, RunningBatch] = {}
        self.torch_thread = torch_thread
        self.watch = StepWatch()  # the steps in flight, against the deadline the warmup chose
        self.instance = uuid.uuid4().hex  # this process's, in Info
        self.stopping = False  # the server stops: open Steps calls end between messages
        self._reading: set[asyncio.Task] = set()  # Steps handlers waiting for their call's next message

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs `fn` on the forward thread as a step, which the watchdog holds to the step deadline."""
        with self.watch.step():
            return await self.torch_thread.run(fn, *args)

    def _take(self, *batch_ids: int) -> list[RunningBatch]:
        """Removes the batches from the cache (a step replaces them), or none if any id is unknown."""
        missing = [i for i in batch_ids if i not in self.cache]
        if missing:
            raise BadRequest(f"batches {missing} are not cached on this shard")
        return [self.cache.pop(i) for i in batch_ids]

    async def _step(
        self, cached_ids: list[int], updates: list[pb.RequestUpdate], new: pb.Batch | None, run: bool = False
    ) -> StepOutput:
        """Runs one step over the cached batches and the new requests; a refused step (BadRequest) leaves the
        cache as it was. Requests are parsed and updated on the worker thread, which alone touches batches.
        The first step of a `run` drops its finished requests from the batch at once."""
        taken = self._take(*cached_ids)
        failpoints.exit_if_asked(new)
        hang = failpoints.hangs(new)

        def step() -> StepOutput:
            if hang:
                failpoints.hang()
            batches = [RunningBatch.concatenate(taken)] if taken else []
            if batches:
                batches[0].update(updates)
            if new is not None:
                batches.append(self.engine.batch(new))
            output = self.engine.step(RunningBatch.concatenate(batches))
            return _without_finished(output) if run else output

        try:
            return await self._run(step)
        except BadRequest:
            self.cache.update((b.id, b) for b in taken)
            raise

    def _keep(self, batch: RunningBatch | None) -> pb.CachedBatch | None:
        if batch is None:
            return None
        self.cache[batch.id] = batch
        return batch.to_pb()

    def _respond(self, response_type, generations, batch: RunningBatch | None, timings: pb.Timings):
        """A step's answer; the batch is cached for the next step unless every request in it finished."""
        response = response_type(generations=generations, timings=timings)
        if (cached := self._keep(batch)) is not None:
            response.batch.CopyFrom(cached)
        return response

    @rpc
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        info = self.engine.info()
        info.pid, info.instance = os.getpid(), self.instance
        return info

    @rpc
    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        if (stuck := self.watch.stuck()) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, stuck)
        return pb.HealthResponse()

    @rpc
    async def ServiceDiscovery(self, request, context) -> pb.ServiceDiscoveryResponse:
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    @rpc
    async def ClearCache(self, request: pb.ClearCacheRequest, context) -> pb.ClearCacheResponse:
        if request.HasField("id"):
            self.cache.pop(request.id, None)
        else:
            self.cache.clear()
        return pb.ClearCacheResponse()

    @rpc
    async def Warmup(self, request: pb.WarmupRequest, context) -> pb.WarmupResponse:
        """Runs the largest prefill (first requests then do not pay for cold memory), sizes the KV pool, and
        times a decode step at the row counts asked (the router's draft choice weighs drafts by them)."""
        if not request.batch.requests:
            raise BadRequest("warmup needs a batch")
        step_timing.check_rows(request.calibrate_rows)
        self.cache.clear()
        start = time.monotonic()
        capacity = await self.torch_thread.run(self.engine.warmup, request)  # not a step: no deadline
        self.watch.timeout = step_timeout(request.step_timeout, time.monotonic() - start)
        seconds, draft = await self.torch_thread.run(step_timing.time_decode_rows, self.engine, request.calibrate_rows)
        return pb.WarmupResponse(
            max_supported_total_tokens=capacity,
            step_timeout=self.watch.timeout,
            step_seconds=seconds,
            draft_step_seconds=draft,
        )

    @rpc
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        return await self._prefill(request)

    @rpc
    async def Decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        return await self._decode(request)

    async def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        if not request.batch.requests:
            raise BadRequest("prefill needs at least one request")
        if request.batch.id in self.cache:
            raise BadRequest(f"batch {request.batch.id} is already cached")
        cached = [request.cached_batch.id] if request.HasField("cached_batch") else []
        return self._respond(pb.PrefillResponse, *await self._step(cached, list(request.updates), request.batch))

    async def _decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if not request.batches:
            raise BadRequest("decode needs at least one batch")
        cached = [b.id for b in request.batches]
        return self._respond(pb.DecodeResponse, *await self._step(cached, list(request.updates), None))

    async def Steps(self, requests, context) -> None:
        """Each message is a Prefill or a Decode, answered in order; a failed one answers the status its unary RPC
        would have failed with, and the call goes on. A stopping server ends the call between two messages."""
        while (message := await self._next_step(context)) is not None:
            kind = message.WhichOneof("step")
            name = f"shard.{kind.capitalize() if kind else 'Step'}"
            with tracing.span(name, tracing.extract(message.trace), kind=SpanKind.SERVER):
                try:
                    if kind == "prefill":
                        response = pb.StepResponse(prefill=await self._prefill(message.prefill))
                    elif kind == "decode":
                        response = pb.StepResponse(decode=await self._decode(message.decode))
                    else:
                        raise BadRequest("a step message is a prefill or a decode")
                except Exception as exc:  # noqa: BLE001 - answered as the unary RPC would fail
                    code, text = _status("Steps", exc)
                    response = pb.StepResponse(error=pb.StepError(code=code.value[0], message=text))
            await context.write(response)

    async def _next_step(self, context: grpc.aio.ServicerContext) -> pb.StepRequest | None:
        """The call's next message; None at its end, or once the server stops (the router keeps its call open,
        which would otherwise hold the server's whole grace period): `stop_steps` cancels a read in progress."""
        task = asyncio.current_task()
        if self.stopping or task is None:
            return None
        self._reading.add(task)
        try:
            message = await context.read()
        except asyncio.CancelledError:
            if self.stopping:
                return None
            raise
        finally:
            self._reading.discard(task)
        return None if message is grpc.aio.EOF else message

    def stop_steps(self) -> None:
        """Ends every open Steps call between two messages: those waiting for one now, the others after their step."""
        self.stopping = True
        for task in self._reading:
            task.cancel()

    @rpc
    async def DecodeRun(self, requests, context) -> None:
        first = await context.read()
        if first is grpc.aio.EOF or not first.decode.batches:
            raise BadRequest("a decode run starts with a decode of at least one batch")
        stop = threading.Event()
        reader = asyncio.create_task(_await_stop(context, stop))
        try:
            await self._decode_run(first.decode, max(1, first.max_steps), stop, context.write)
        finally:
            reader.cancel()

    async def _decode_run(
        self, decode: pb.DecodeRequest, max_steps: int, stop: threading.Event, write: Callable[..., Awaitable[None]]
    ) -> None:
        """Each step's answer is written, then the next step runs; the batch is cached again once the run ends
        (before its last answer, which the router waits for before its next call)."""
        cached = [b.id for b in decode.batches]
        output: StepOutput | None = await self._step(cached, list(decode.updates), None, run=True)
        steps = 1
        while output is not None:
            generations, batch, timings = output
            response = pb.DecodeResponse(generations=generations, timings=timings)
            if batch is not None:
                response.batch.CopyFrom(batch.to_pb())
            more = batch is not None and steps < max_steps
            if not more:
                self._keep(batch)
            await write(response)
            if not more:
                return
            output = await self._run(self._run_step, batch, stop)
            steps += 1
            if output is None:  # stopped: the batch is as the last answer left it
                self._keep(batch)

    def _run_step(self, batch: RunningBatch, stop: threading.Event) -> StepOutput | None:
        """A run's next step, on the torch thread; None once the router asked to stop. Ranks read the request at
        different moments, so they agree first (any rank that saw it stops them all): their forwards must pair."""
        if self.engine.group.min(0 if stop.is_set() else 1) == 0:
            return None
        return _without_finished(self.engine.step(batch))

    @rpc
    async def FilterBatch(self, request: pb.FilterBatchRequest, context) -> pb.FilterBatchResponse:
        (batch,) = self._take(request.batch_id)
        try:
            kept = await self._run(batch.filter, list(request.request_ids))
        except KeyError as exc:
            self.cache[batch.id] = batch
            raise BadRequest(str(exc)) from None
        return pb.FilterBatchResponse(batch=self._keep(kept))

    @rpc
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        """Resolves the source (a Hub id downloads) and reads the files off the torch thread, the read within
        `read_timeout()` (CONVEYOR_ADAPTER_READ_TIMEOUT), then installs the adapter between steps: a file that blocks
        on read stalls this load alone, never the tenants' steps. A source or an adapter that does not fit is
        INVALID_ARGUMENT, with the line that says why (a read that does not end leaves its thread blocked on the file,
        and the load refused)."""
        name = request.name
        folder = await asyncio.to_thread(resolve_source, name, request.source)
        try:
            files = await asyncio.wait_for(asyncio.to_thread(self.engine.read_adapter, name, folder), read_timeout())
        except asyncio.TimeoutError:
            raise AdapterError(f"adapter {name!r}: its files were not read within {read_timeout():g} s") from None
        adapter = await self.torch_thread.run(self.engine.load_adapter, name, request.source, files)
        return pb.LoadAdapterResponse(adapter=adapter)

    @rpc
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        """Drops the adapter between steps; INVALID_ARGUMENT for one not loaded or still named by a cached request."""
        await self.torch_thread.run(self.engine.unload_adapter, request.name)
        return pb.UnloadAdapterResponse()


def _without_finished(output: StepOutput) -> StepOutput:
    """A run's step leaves its finished requests out of the batch itself (the router has no turn between steps)."""
    generations, batch, timings = output
    finished = {g.request_id for g in generations if g.HasField("finished")}
    if batch is None or not finished:
        return output
    live = [r.id for r in batch.requests if r.id not in finished]
    return generations, batch.filter(live) if live else None, timings


async def _await_stop(context: grpc.aio.ServicerContext, stop: threading.Event) -> None:
    """Sets `stop` when the router's `stop` message comes (the end of its messages is not one)."""
    message = await context.read()
    if message is not grpc.aio.EOF and message.stop:
        stop.set()


async def serve(
    engine: Engine, torch_thread: TorchThread, bind: str, urls: list[str], security: Security, stop: asyncio.Event
) -> None:
    """Serves at `bind` until `stop` is set, then lets in-flight RPCs finish for a few seconds. `urls` are every
    rank's addresses (ServiceDiscovery's answer). The server starts only once the model is loaded and the group
    formed; the standard health service then says SERVING, and NOT_SERVING while a step is past its deadline."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=security.interceptors())
    service = ShardService(engine, urls, torch_thread)
    pb_grpc.add_ShardServicer_to_server(service, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    security.add_port(server, bind)
    await server.start()
    log.info("shard serving", extra={"url": bind, "rank": engine.group.rank, "tls": security.cert is not None})
    watchdog = asyncio.create_task(HealthReport(service.watch, health_service).run())
    await stop.wait()
    watchdog.cancel()
    service.stop_steps()
    await server.stop(grace=5)
    log.info("shard stopped")
