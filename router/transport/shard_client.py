"""The router's view of a deployment: every RPC goes to every rank, and a step succeeds only if all ranks do.

Ranks run the same forward in lockstep and answer the same tokens; the first rank's answer is the step's. Calls take
and return the records of records.py; wire.py turns them into the proto's messages and back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from conveyor.router.transport import wire
from conveyor.router.transport.records import (
    Batch,
    CachedBatch,
    RequestUpdate,
    ShardAdapter,
    ShardInfo,
    StepResult,
    Warmed,
    Warmup,
)
from conveyor.shard_channels import LOOPBACK, Security, parse_tcp
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
Metadata = list[tuple[str, str]] | None


class ShardError(RuntimeError):
    """A rank failed an RPC; the message names the rank, the RPC and the shard's own error text."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.code = code  # the gRPC status, if the rank answered one
        self.detail = detail or message  # the shard's own text, without which rank and RPC failed

    @property
    def timed_out(self) -> bool:
        return self.code is grpc.StatusCode.DEADLINE_EXCEEDED


class ShardedClient:
    def __init__(self, urls: list[str], security: Security | None = None) -> None:
        self.urls = urls
        # Seconds a step (and a filter or clear) may take before the shards count as hung; None waits for ever.
        self.step_timeout: float | None = None
        self.pids: list[int] = []  # every rank's process id, when known: `kill` needs them
        self.instances: list[str] = []  # every rank's instance id when warmed up: another means it was restarted
        # With several nodes, how to restart the whole group (move its epoch on): pids mean nothing across hosts.
        self.restart_group: Callable[[], object] | None = None
        self._channels = [(security or Security()).aio_channel(u) for u in urls]
        self._stubs = [pb_grpc.ShardStub(c) for c in self._channels]
        self._steps: list[grpc.aio.StreamStreamCall] | None = None  # every rank's open Steps call

    def kill(self) -> None:
        """Restarts a hung group, which cannot be asked to stop. Across nodes, by moving the group's epoch on
        (every node's launcher then restarts its ranks); on this host, by SIGKILLing every rank (the launcher then
        restarts the group). Shards elsewhere that are not a launcher's group (separate containers, say) cannot be
        killed from here: their supervisor must restart them."""
        if self.restart_group is not None:
            self.restart_group()
            return
        if not all(_local(url) for url in self.urls):
            log.error("the shards are hung and not on this host: their supervisor must restart them")
            return
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    @classmethod
    async def connect(cls, address: str, security: Security | None = None, timeout: float = 10.0) -> ShardedClient:
        """`address` is rank 0's (then the others are discovered from it) or every rank's, comma-separated."""
        urls = [u.strip() for u in address.split(",") if u.strip()]
        if len(urls) > 1:
            return cls(urls, security)
        master = cls(urls, security)
        try:
            response = await master._all(
                "ServiceDiscovery", lambda s: s.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout)
            )
        finally:
            await master.close()
        return cls(list(response[0].urls), security)

    async def close(self) -> None:
        self._drop_steps()
        await asyncio.gather(*(c.close() for c in self._channels))

    async def _all(self, name: str, call: Callable[[pb_grpc.ShardStub], Awaitable[T]]) -> list[T]:
        """Runs `call` on every rank at once."""
        return await _gather(name, [call(s) for s in self._stubs])

    async def infos(self, timeout: float | None = None) -> list[ShardInfo]:
        """Every rank's Info (each names its own process id and instance)."""
        responses = await self._all("Info", lambda s: s.Info(pb.InfoRequest(), timeout=timeout))
        return [wire.shard_info(r) for r in responses]

    async def info(self) -> ShardInfo:
        return (await self.infos())[0]

    async def health(self, timeout: float = 5.0) -> None:
        await self._all("Health", lambda s: s.Health(pb.HealthRequest(), timeout=timeout))

    async def clear_cache(self, batch_id: int | None = None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._all("ClearCache", lambda s: s.ClearCache(request, timeout=self.step_timeout))

    async def load_adapter(self, name: str, source: str) -> list[ShardAdapter]:
        """Every rank loads the adapter (a Hub id is downloaded first, so there is no deadline); each says what it
        loaded."""
        request = pb.LoadAdapterRequest(name=name, source=source)
        responses = await self._all("LoadAdapter", lambda s: s.LoadAdapter(request))
        return [wire.adapter(r.adapter) for r in responses]

    async def unload_adapter(self, name: str) -> None:
        request = pb.UnloadAdapterRequest(name=name)
        await self._all("UnloadAdapter", lambda s: s.UnloadAdapter(request, timeout=self.step_timeout))

    async def warmup(self, warmup: Warmup, timeout: float | None = None) -> Warmed:
        request = wire.warmup_pb(warmup)
        responses = await self._all("Warmup", lambda s: s.Warmup(request, timeout=timeout))
        return Warmed(
            capacity=min(r.max_supported_total_tokens for r in responses),
            step_timeout=max(r.step_timeout for r in responses),
            step_seconds=tuple(max(times) for times in zip(*(r.step_seconds for r in responses))),
            draft_step_seconds=max(r.draft_step_seconds for r in responses),
        )

    async def prefill(
        self,
        batch: Batch,
        metadata: Metadata = None,
        cached_batch: CachedBatch | None = None,
        updates: list[RequestUpdate] = (),
    ) -> StepResult:
        """`metadata` carries the trace context, so the shards' spans join the request's trace. With a
        `cached_batch` the new requests join that running batch in the same forward (a mixed step)."""
        request = wire.prefill_pb(batch, cached_batch, updates)
        return await self._step("Prefill", pb.StepRequest(prefill=request, trace=dict(metadata or ())))

    async def decode(
        self, batches: list[CachedBatch], metadata: Metadata = None, updates: list[RequestUpdate] = ()
    ) -> StepResult:
        request = wire.decode_pb(batches, updates)
        return await self._step("Decode", pb.StepRequest(decode=request, trace=dict(metadata or ())))

    async def _step(self, name: str, request: pb.StepRequest) -> StepResult:
        """One step on every rank, over each rank's open `Steps` call (opened at the first step, and again after a
        call failed): answered as the unary RPC would answer, an error message failing the step as its status
        would. A call that breaks or passes the step deadline is dropped, and the step fails."""
        if self._steps is None:
            self._steps = [s.Steps() for s in self._stubs]
        calls = self._steps
        try:
            await _gather(name, [c.write(request) for c in calls], self.step_timeout)
            responses = await _gather(name, [c.read() for c in calls], self.step_timeout)
        except ShardError:
            self._drop_steps()
            raise
        for rank, response in enumerate(responses):
            if response is grpc.aio.EOF:
                self._drop_steps()
                raise ShardError(f"shard {rank} ended its Steps call", grpc.StatusCode.UNAVAILABLE)
            if response.HasField("error"):
                code = _STATUS_CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)
                detail = response.error.message
                raise ShardError(f"shard {rank} failed {name}: {detail}", code, detail)
        return wire.step_result([getattr(r, r.WhichOneof("result")) for r in responses])

    def _drop_steps(self) -> None:
        for call in self._steps or []:
            call.cancel()
        self._steps = None

    async def decode_run(
        self,
        batches: list[CachedBatch],
        max_steps: int,
        metadata: Metadata = None,
        updates: list[RequestUpdate] = (),
    ) -> DecodeRun:
        """Starts up to `max_steps` decode steps on every rank; read them with `DecodeRun.next`."""
        calls = [s.DecodeRun(metadata=metadata) for s in self._stubs]
        run = DecodeRun(calls, self.step_timeout)
        first = pb.DecodeRunRequest(decode=wire.decode_pb(batches, updates), max_steps=max_steps)
        try:
            await _gather("DecodeRun", [c.write(first) for c in calls], self.step_timeout)
        except ShardError:
            run.close()
            raise
        return run

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        responses = await self._all("FilterBatch", lambda s: s.FilterBatch(request, timeout=self.step_timeout))
        return wire.cached_batch(responses[0].batch)


class DecodeRun:
    """A decode run in progress on every rank: its steps' results in order, and how to end it early."""

    def __init__(self, calls: list[grpc.aio.StreamStreamCall], step_timeout: float | None) -> None:
        self.calls, self.step_timeout = calls, step_timeout
        self.stopping = False

    async def next(self) -> StepResult | None:
        """The next step's result, or None once the run has ended; every rank must end at the same step."""
        responses = await _gather("DecodeRun", [c.read() for c in self.calls], self.step_timeout)
        ended = [r is grpc.aio.EOF for r in responses]
        if all(ended):
            return None
        if any(ended):
            raise ShardError(f"ranks {[i for i, e in enumerate(ended) if e]} ended a decode run before the others")
        return wire.step_result(responses)

    async def stop(self) -> None:
        """Asks every rank to end the run after the step in progress; its results still come through `next`."""
        if self.stopping:
            return
        self.stopping = True
        stop = pb.DecodeRunRequest(stop=True)
        for call in self.calls:
            try:
                await call.write(stop)
                await call.done_writing()
            except Exception:  # noqa: BLE001 - the run already ended there (or failed: `next` says so)
                pass

    def close(self) -> None:
        for call in self.calls:
            call.cancel()


async def _gather(name: str, calls: list[Awaitable[T]], timeout: float | None = None) -> list[T]:
    """Awaits one call per rank at once; the first failure fails the whole call at once, without waiting for the
    other ranks (when one rank dies, the others may wait for it in a collective for ever). `timeout` is for calls
    that carry no deadline of their own (a stream's reads). One rank's call is awaited as it is: no task, no
    wait (a step pays this twice, at every token)."""
    if len(calls) == 1:
        return [await _one(name, calls[0], timeout)]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION)
        for rank, task in enumerate(tasks):
            if task.done() and (exc := task.exception()) is not None:
                raise _shard_error(rank, name, exc)
        if len(done) < len(tasks):
            late = [rank for rank, task in enumerate(tasks) if not task.done()]
            raise ShardError(f"shards {late} did not answer {name} in {timeout} s", grpc.StatusCode.DEADLINE_EXCEEDED)
        return [t.result() for t in tasks]
    finally:
        for task in tasks:
            task.cancel()


async def _one(name: str, call: Awaitable[T], timeout: float | None) -> T:
    try:
        return await _within(call, timeout)
    except asyncio.TimeoutError:
        raise ShardError(
            f"shards [0] did not answer {name} in {timeout} s", grpc.StatusCode.DEADLINE_EXCEEDED
        ) from None
    except Exception as exc:  # noqa: BLE001 - as _gather names a failed rank's error
        raise _shard_error(0, name, exc) from exc


async def _within(call: Awaitable[T], timeout: float | None) -> T:
    """`call`, cancelled after `timeout` seconds: by asyncio.timeout where there is one (3.11), which makes no task."""
    if timeout is None:
        return await call
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await call
    return await asyncio.wait_for(call, timeout)


def _shard_error(rank: int, name: str, exc: BaseException) -> ShardError:
    if isinstance(exc, grpc.aio.AioRpcError):
        detail = exc.details() or exc.code().name
        return ShardError(f"shard {rank} failed {name}: {detail}", exc.code(), detail)
    return ShardError(f"shard {rank} failed {name}: {exc!r}")


def _local(url: str) -> bool:
    """Whether a shard URL is surely on this host (a unix socket, or TCP on loopback)."""
    if not url.startswith("tcp://"):
        return True
    host, _ = parse_tcp(url)
    return host in (LOOPBACK, "localhost", "::1") or host.startswith("127.")
