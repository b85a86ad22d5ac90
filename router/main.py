"""`conveyor-router`: connects to the shards, warms them up, and serves HTTP until told to stop.

Startup follows TGI's order: discover every rank from rank 0, clear their caches, read `Info`, run `Warmup`
with the largest prefill the limits allow, then listen. SIGTERM/SIGINT stop new requests (503) and let those
in flight finish before the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from conveyor import log as conveyor_log
from conveyor import tracing
from conveyor.router.shard_client import ShardedClient
from conveyor.router.block_allocator import BlockAllocator
from conveyor.router import grpc_server as grpc_front_door
from conveyor.router.grpc_server import TextGenerationService
from conveyor.router.http import HttpServer, ServerInfo
from conveyor.router.infer import Infer
from conveyor.router.metrics import Metrics
from conveyor.router.limits import LimitArgs, LimitError, ResolvedLimits, resolve_limits, warmup_request
from conveyor.router.scheduler import Scheduler
from conveyor.router.step_planner import PlannerConfig, Scheduling
from conveyor.router.validation import Validation

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Conveyor router: HTTP front end, queue and batching loop.")
    p.add_argument("--model-id", required=True, help="the model directory (its tokenizer validates requests)")
    p.add_argument("--master-shard-uds-path", default="/tmp/conveyor-shard-0")
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC front door on this port")
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-input-tokens", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=None)
    p.add_argument("--max-batch-total-tokens", type=int, default=None)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--waiting-served-ratio", type=float, default=0.3)
    p.add_argument("--max-waiting-tokens", type=int, default=20)
    p.add_argument("--scheduling", choices=[m.value for m in Scheduling], default=Scheduling.CONTINUOUS.value,
                   help="paged engine: continuous (default), static (full batches run to completion) or sequential")
    p.add_argument("--static-batch-timeout", type=float, default=1.0,
                   help="static scheduling: seconds a batch waits to fill up to --max-batch-size")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="paged engine: prompt tokens per step while streams are decoding (default: 64 on CPU, "
                        "512 on GPU)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="paged engine: share the KV blocks of common prompt prefixes (default on)")
    p.add_argument("--max-stop-sequences", type=int, default=4)
    p.add_argument("--max-top-n-tokens", type=int, default=5)
    p.add_argument("--graceful-termination-timeout", type=float, default=60.0)
    p.add_argument("--api-key", default=os.environ.get("CONVEYOR_API_KEY"),
                   help="required as 'Authorization: Bearer KEY' on POST routes (default: $CONVEYOR_API_KEY)")
    p.add_argument("--payload-limit", type=int, default=2_000_000, help="largest request body in bytes (413 above)")
    p.add_argument("--log-level", default=None)
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans there (OTLP/gRPC)")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    client = await ShardedClient.connect(args.master_shard_uds_path)
    await client.clear_cache()
    shard_info = await client.info()
    tokenizer = AutoTokenizer.from_pretrained(args.model_id)
    limits = resolve_limits(LimitArgs.from_namespace(args), shard_info, tokenizer)
    log.info("warming up", extra={"max_batch_prefill_tokens": limits.max_batch_prefill_tokens})
    capacity = await client.warmup(warmup_request(limits, tokenizer))
    limits = limits.with_capacity(capacity)

    metrics = Metrics()
    scheduler = make_scheduler(args, client, shard_info, limits, metrics)
    infer = Infer(scheduler, args.max_concurrent_requests, metrics)
    server = HttpServer(
        infer,
        Validation(tokenizer, limits.validation),
        ServerInfo(
            model_id=args.model_id,
            model_dtype=shard_info.dtype,
            engine=shard_info.engine,
            limits=limits.validation,
            max_concurrent_requests=args.max_concurrent_requests,
            max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
            max_batch_total_tokens=limits.max_batch_total_tokens,
            max_batch_size=args.max_batch_size,
            waiting_served_ratio=args.waiting_served_ratio,
            max_waiting_tokens=args.max_waiting_tokens,
            num_shard=len(client.urls),
        ),
        api_key=args.api_key,
        payload_limit=args.payload_limit,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    batching = asyncio.create_task(scheduler.run(), name="batching")
    batching.add_done_callback(lambda _: stop.set())

    grpc_server = None
    if args.grpc_port:
        service = TextGenerationService(infer, server.validation, server.info, args.api_key)
        grpc_server = await grpc_front_door.start(service, args.hostname, args.grpc_port)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.hostname, args.port).start()
    log.warning("router listening", extra={"url": f"http://{args.hostname}:{args.port}"})
    await stop.wait()

    if batching.done():
        await runner.cleanup()
        batching.result()  # re-raises the loop's crash so the process exits non-zero
        raise RuntimeError("the batching loop stopped")
    server.draining = True
    log.info("draining", extra={"in_flight": infer.in_flight})
    if grpc_server is not None:
        await grpc_server.stop(grace=args.graceful_termination_timeout)  # refuses new calls, finishes the rest
    await _drain(infer, args.graceful_termination_timeout)
    await runner.cleanup()
    batching.cancel()
    await client.close()
    log.info("router stopped")


# Prompt tokens per step while streams decode: on CPU a step's cost grows with every token, so a chunk of 64
# keeps a mixed step within about twice a decode step (benchmarks/compare.py, long-prompt workload).
DEFAULT_CHUNK_TOKENS = {"cpu": 64}


def make_scheduler(
    args: argparse.Namespace, client: ShardedClient, shard_info, limits: ResolvedLimits, metrics: Metrics
) -> Scheduler:
    allocator = BlockAllocator(limits.max_batch_total_tokens // shard_info.block_size, shard_info.block_size,
                               prefix_caching=args.prefix_caching)  # fmt: skip
    planner = PlannerConfig(
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens or DEFAULT_CHUNK_TOKENS.get(shard_info.device_type, 512),
        max_batch_size=args.max_batch_size,
        scheduling=Scheduling(args.scheduling),
        static_batch_timeout=args.static_batch_timeout,
        watermark_blocks=allocator.num_blocks // 100,
    )
    return Scheduler(client, planner, allocator, metrics)


async def _drain(infer: Infer, timeout: float) -> None:
    """Waits until every in-flight request has finished, or the timeout passes."""
    deadline = time.monotonic() + timeout
    while infer.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conveyor_log.setup("router", args.log_level)
    tracing.setup("conveyor-router", args.otlp_endpoint)
    try:
        asyncio.run(run(args))
    except LimitError as exc:
        log.error("invalid limits: %s", exc)
        sys.exit(1)
    except Exception:
        log.exception("router failed")
        sys.exit(1)
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
