"""The router's view of a deployment: every RPC goes to every rank, and a step succeeds only if all ranks do.

Ranks run the same forward in lockstep and answer the same tokens; the first rank's answer is the step's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

T = TypeVar("T")
Metadata = list[tuple[str, str]] | None

CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class ShardError(RuntimeError):
    """A rank failed an RPC; the message names the rank, the RPC and the shard's own error text."""


@dataclass
class StepResult:
    generations: list[pb.Generation]
    batch: pb.CachedBatch | None
    timings: pb.Timings


class ShardedClient:
    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._channels = [grpc.aio.insecure_channel(u, options=CHANNEL_OPTIONS) for u in urls]
        self._stubs = [pb_grpc.ShardStub(c) for c in self._channels]

    @classmethod
    async def connect(cls, master_uds: str, timeout: float = 10.0) -> ShardedClient:
        """Asks rank 0 (at `master_uds`) for every rank's address and connects to all of them."""
        master = cls([_unix_url(master_uds)])
        try:
            response = await master._all(
                "ServiceDiscovery", lambda s: s.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout)
            )
        finally:
            await master.close()
        return cls(list(response[0].urls))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))

    async def _all(self, name: str, call: Callable[[pb_grpc.ShardStub], Awaitable[T]]) -> list[T]:
        """Runs `call` on every rank at once and waits for all; the first failure fails the whole call."""
        results = await asyncio.gather(*(call(s) for s in self._stubs), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, grpc.aio.AioRpcError):
                raise ShardError(f"shard {rank} failed {name}: {result.details() or result.code().name}")
            if isinstance(result, BaseException):
                raise ShardError(f"shard {rank} failed {name}: {result!r}")
        return results  # type: ignore[return-value]

    async def info(self) -> pb.InfoResponse:
        return (await self._all("Info", lambda s: s.Info(pb.InfoRequest())))[0]

    async def health(self, timeout: float = 5.0) -> None:
        await self._all("Health", lambda s: s.Health(pb.HealthRequest(), timeout=timeout))

    async def clear_cache(self, batch_id: int | None = None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._all("ClearCache", lambda s: s.ClearCache(request))

    async def warmup(self, request: pb.WarmupRequest) -> int:
        """Returns the KV capacity in tokens the smallest rank supports."""
        responses = await self._all("Warmup", lambda s: s.Warmup(request))
        return min(r.max_supported_total_tokens for r in responses)

    async def prefill(
        self,
        batch: pb.Batch,
        metadata: Metadata = None,
        cached_batch: pb.CachedBatch | None = None,
        updates: list[pb.RequestUpdate] = (),
    ) -> StepResult:
        """`metadata` carries the trace context, so the shards' spans join the request's trace. With a
        `cached_batch` the new requests join that running batch in the same forward (a mixed step)."""
        request = pb.PrefillRequest(batch=batch, cached_batch=cached_batch, updates=updates)
        return _step_result(await self._all("Prefill", lambda s: s.Prefill(request, metadata=metadata)))

    async def decode(
        self, batches: list[pb.CachedBatch], metadata: Metadata = None, updates: list[pb.RequestUpdate] = ()
    ) -> StepResult:
        request = pb.DecodeRequest(batches=batches, updates=updates)
        return _step_result(await self._all("Decode", lambda s: s.Decode(request, metadata=metadata)))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        return (await self._all("FilterBatch", lambda s: s.FilterBatch(request)))[0].batch


def _unix_url(path: str) -> str:
    return path if path.startswith("unix:") else f"unix://{path}"


def _step_result(responses: list[Any]) -> StepResult:
    first = responses[0]
    slowest = max(responses, key=lambda r: r.timings.total_ns)
    return StepResult(
        generations=list(first.generations),
        batch=first.batch if first.HasField("batch") else None,
        timings=slowest.timings,
    )
