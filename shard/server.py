"""The shard's gRPC service: cached batches by id, and the engine behind them.

Forwards run on one worker thread (torch releases the GIL), so the event loop keeps answering `Health`
while a long prefill runs, and batches are only ever touched by that one thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

import grpc
from opentelemetry.trace import SpanKind

from conveyor import tracing
from conveyor.shard.causal_lm import CausalLM, CausalLMBatch
from conveyor.shard.paged_batch import PagedBatch
from conveyor.shard.paged_lm import PagedCausalLM
from conveyor.shard.requests import BadRequest
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Model = CausalLM | PagedCausalLM
Batch = CausalLMBatch | PagedBatch


def rpc(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turns any exception of a handler into a gRPC error carrying its message, and keeps the shard serving."""

    @functools.wraps(handler)
    async def wrapper(self: "ShardService", request: Any, context: grpc.aio.ServicerContext) -> Any:
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
    def __init__(self, model: Model, urls: list[str]) -> None:
        self.model = model
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

    async def _step_on(self, taken: list[Batch], fn: Callable[..., Any], *args: Any) -> Any:
        """Runs a step over batches taken from the cache; a refused step (BadRequest) puts them back as they were."""
        try:
            return await self._run(fn, *args)
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
        return self.model.info()

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
        capacity = await self._run(self.model.warmup, request)
        return pb.WarmupResponse() if capacity is None else pb.WarmupResponse(max_supported_total_tokens=capacity)

    @rpc
    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        if not request.batch.requests:
            raise BadRequest("prefill needs at least one request")
        if request.batch.id in self.cache:
            raise BadRequest(f"batch {request.batch.id} is already cached")
        if not isinstance(self.model, PagedCausalLM):
            if request.HasField("cached_batch") or request.updates:
                raise BadRequest("this engine does not support chunked prefill (cached_batch, updates)")
            return self._respond(pb.PrefillResponse, *await self._run(self.model.prefill, request.batch))
        taken = self._take(request.cached_batch.id) if request.HasField("cached_batch") else []
        cached = taken[0] if taken else None
        result = await self._step_on(taken, self.model.prefill, request.batch, cached, list(request.updates))
        return self._respond(pb.PrefillResponse, *result)

    @rpc
    async def Decode(self, request: pb.DecodeRequest, context) -> pb.DecodeResponse:
        if not request.batches:
            raise BadRequest("decode needs at least one batch")
        if request.updates and not isinstance(self.model, PagedCausalLM):
            raise BadRequest("this engine does not take request updates")
        batches = self._take(*(b.id for b in request.batches))
        args = (batches, list(request.updates)) if request.updates else (batches,)
        return self._respond(pb.DecodeResponse, *await self._step_on(batches, self.model.decode, *args))

    @rpc
    async def FilterBatch(self, request: pb.FilterBatchRequest, context) -> pb.FilterBatchResponse:
        (batch,) = self._take(request.batch_id)
        try:
            kept = await self._run(batch.filter, list(request.request_ids))
        except KeyError as exc:
            self.cache[batch.id] = batch
            raise BadRequest(str(exc)) from None
        return pb.FilterBatchResponse(batch=self._keep(kept))


async def serve(model: Model, uds_path: str, rank: int, world_size: int, stop: asyncio.Event) -> None:
    """Serves until `stop` is set, then lets in-flight RPCs finish for a few seconds."""
    urls = [f"unix://{uds_path}-{r}" for r in range(world_size)]
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    )
    pb_grpc.add_ShardServicer_to_server(ShardService(model, urls), server)
    server.add_insecure_port(urls[rank])
    await server.start()
    log.info("shard serving", extra={"url": urls[rank], "rank": rank})
    await stop.wait()
    await server.stop(grace=5)
    log.info("shard stopped")
