"""The shard's gRPC service: cached batches by id, and the engine behind them.

`Prefill` and `Decode` are the same step: the cached batches named (the running one, with this step's
`updates`), joined by the new requests of a `Prefill`, run one `Engine.step`.

Forwards run on one worker thread (torch releases the GIL), so the event loop keeps answering `Health`
while a long prefill runs, and batches are only ever touched by that one thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from conveyor.shard.batch import Batch
from conveyor.shard.engine import Engine, StepOutput
from conveyor.shard.requests import BadRequest
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2_grpc
from opentelemetry.trace import SpanKind

from conveyor import tracing
from conveyor.shard_channels import CHANNEL_OPTIONS, Security

log = logging.getLogger(__name__)

# A failpoint for the fault tests: with CONVEYOR_FAILPOINT_EXIT_ON_TOKEN=<token id> in its environment, a shard
# dies at once (as on a segfault) at any step that reads a prompt containing that token: "the request that
# crashes the shard every time". Unset, it costs one comparison per step.
FAILPOINT_TOKEN = (
    int(os.environ["CONVEYOR_FAILPOINT_EXIT_ON_TOKEN"]) if "CONVEYOR_FAILPOINT_EXIT_ON_TOKEN" in os.environ else None
)
FAILPOINT_EXIT_CODE = 70


def rpc(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turns any exception of a handler into a gRPC error carrying its message, and keeps the shard serving."""

    @functools.wraps(handler)
    async def wrapper(self: ShardService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        parent = tracing.extract(dict(context.invocation_metadata() or ()))
        try:
            with tracing.span(f"shard.{handler.__name__}", parent, kind=SpanKind.SERVER):
                return await handler(self, request, context)
        except BadRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - the message goes back to the router
            log.exception("rpc failed", extra={"rpc": handler.__name__})
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    return wrapper


class ShardService(pb_grpc.ShardServicer):
    def __init__(self, engine: Engine, urls: list[str]) -> None:
        self.engine = engine
        self.urls = urls
        self.cache: dict[int, Batch] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _take(self, *batch_ids: int) -> list[Batch]:
        """Removes the batches from the cache (a step replaces them), or none if any id is unknown."""
        missing = [i for i in batch_ids if i not in self.cache]
        if missing:
            raise BadRequest(f"batches {missing} are not cached on this shard")
        return [self.cache.pop(i) for i in batch_ids]

    async def _step(self, cached_ids: list[int], updates: list[pb.RequestUpdate], new: pb.Batch | None) -> StepOutput:
        """Runs one step over the cached batches and the new requests; a refused step (BadRequest) leaves the
        cache as it was. Requests are parsed and updated on the worker thread, which alone touches batches."""
        taken = self._take(*cached_ids)
        if (
            new is not None
            and FAILPOINT_TOKEN is not None
            and any(FAILPOINT_TOKEN in r.input_ids for r in new.requests)
        ):
            log.error("failpoint: exiting", extra={"token": FAILPOINT_TOKEN})
            os._exit(FAILPOINT_EXIT_CODE)

        def step() -> StepOutput:
            batches = [Batch.concatenate(taken)] if taken else []
            if batches:
                batches[0].update(updates)
            if new is not None:
                batches.append(Batch.from_pb(new, self.engine.states(new)))
            return self.engine.step(Batch.concatenate(batches))

        try:
            return await self._run(step)
        except BadRequest:
            self.cache.update((b.id, b) for b in taken)
            raise

    def _keep(self, batch: Batch | None) -> pb.CachedBatch | None:
        if batch is None:
            return None
        self.cache[batch.id] = batch
        return batch.to_pb()

    def _respond(self, response_type, generations, batch: Batch | None, timings: pb.Timings):
        """A step's answer; the batch is cached for the next step unless every request in it finished."""
        response = response_type(generations=generations, timings=timings)
        if (cached := self._keep(batch)) is not None:
            response.batch.CopyFrom(cached)
        return response

    @rpc
    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        info = self.engine.info()
        info.pid = os.getpid()
        return info

    @rpc
    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
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
        """Runs the largest prefill (first requests then do not pay for cold memory) and sizes the KV pool."""
        if not request.batch.requests:
            raise BadRequest("warmup needs a batch")
        self.cache.clear()
        capacity = await self._run(self.engine.warmup, request)
        return pb.WarmupResponse(max_supported_total_tokens=capacity)

    @rpc
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if not request.batch.requests:
            raise BadRequest("prefill needs at least one request")
        if request.batch.id in self.cache:
            raise BadRequest(f"batch {request.batch.id} is already cached")
        cached = [request.cached_batch.id] if request.HasField("cached_batch") else []
        return self._respond(pb.PrefillResponse, *await self._step(cached, list(request.updates), request.batch))

    @rpc
    async def Decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        if not request.batches:
            raise BadRequest("decode needs at least one batch")
        cached = [b.id for b in request.batches]
        return self._respond(pb.DecodeResponse, *await self._step(cached, list(request.updates), None))

    @rpc
    async def FilterBatch(self, request: pb.FilterBatchRequest, context) -> pb.FilterBatchResponse:
        (batch,) = self._take(request.batch_id)
        try:
            kept = await self._run(batch.filter, list(request.request_ids))
        except KeyError as exc:
            self.cache[batch.id] = batch
            raise BadRequest(str(exc)) from None
        return pb.FilterBatchResponse(batch=self._keep(kept))


async def serve(engine: Engine, bind: str, urls: list[str], security: Security, stop: asyncio.Event) -> None:
    """Serves at `bind` until `stop` is set, then lets in-flight RPCs finish for a few seconds. `urls` are every
    rank's addresses (ServiceDiscovery's answer). The standard health service says SERVING from the start: the
    server starts only once the model is loaded and the group formed."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS, interceptors=security.interceptors())
    pb_grpc.add_ShardServicer_to_server(ShardService(engine, urls), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    security.add_port(server, bind)
    await server.start()
    log.info("shard serving", extra={"url": bind, "rank": engine.group.rank, "tls": security.cert is not None})
    await stop.wait()
    await server.stop(grace=5)
    log.info("shard stopped")
