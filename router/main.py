"""`conveyor-router`: connects to the shards, warms them up, and serves HTTP until told to stop.

Startup follows TGI's order: discover every rank from rank 0, clear their caches, read `Info`, run `Warmup`
with the largest prefill the limits allow, then listen. SIGTERM/SIGINT stop new requests (503) and let those
in flight finish before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from aiohttp import web

from conveyor import config, lifeline, tracing
from conveyor import log as conveyor_log
from conveyor.config import Config
from conveyor.group_store import GroupStore
from conveyor.keys import load_keys
from conveyor.model_source import resolve_model
from conveyor.router.core.adapter_registry import AdapterRegistry
from conveyor.router.core.block_allocator import BlockAllocator
from conveyor.router.core.draft_choice import step_costs
from conveyor.router.core.groups import Groups
from conveyor.router.core.infer import Infer
from conveyor.router.core.placement import placement_for
from conveyor.router.core.queue import GroupQueue, Queue
from conveyor.router.core.scheduler import Reconnect, Scheduler
from conveyor.router.core.step_planner import PlannerConfig
from conveyor.router.frontends import grpc_server as grpc_front_door
from conveyor.router.frontends.app import HttpServer
from conveyor.router.frontends.connections import ClientCap, ConnectionLimits
from conveyor.router.frontends.grpc_server import TextGenerationService
from conveyor.router.limits import LimitError
from conveyor.router.metrics import Metrics
from conveyor.router.pipeline.image_urls import ImageUrls
from conveyor.router.pipeline.images import ImageLimits
from conveyor.router.pipeline.output_parsers import output_parsers
from conveyor.router.pipeline.prompt_requests import TaskError, Tasks
from conveyor.router.pipeline.tokenizer_loading import load_tokenizer
from conveyor.router.pipeline.validation import Validation
from conveyor.router.server_info import ServerInfo
from conveyor.router.transport.connect import (
    Connection,
    check_same_model,
    connect,
    first_connect,
    group_addresses,
)
from conveyor.shard_channels import Security

log = logging.getLogger(__name__)


async def run(args: Config) -> None:
    keys = load_keys(args.api_keys_file, args.api_key)
    conveyor_log.add_secrets([args.metrics_key, args.shard_token])
    tokenizer = load_tokenizer(args.model_id)
    tasks = Tasks.read(args.task, args.model_id, tokenizer)  # before the shards are reached: a bad --task stops here
    log.info("tasks", extra={"tasks": list(tasks.served), "pooling": tasks.pooling.mode})
    security = Security.from_config(args)
    store = GroupStore(args.master_addr, args.master_port, False, args.startup_timeout) if args.nnodes > 1 else None
    metrics = Metrics()
    connection, groups = await connect_groups(args, tokenizer, security, store, metrics)
    shard_info, limits = connection.info, connection.limits
    infer = Infer(groups, args.max_concurrent_requests, metrics)
    observe = metrics.grammar_compile.observe
    parsers = output_parsers(args.model_id, tokenizer, args.tool_call_parser, args.reasoning_parser)
    log.info("output parsers", extra={"tool_calls": parsers.tool_format.name, "reasoning": parsers.reasoning})
    validation = Validation(
        tokenizer,
        limits.validation,
        on_compile=observe,
        model_dir=args.model_id,
        chat_special_tokens=args.chat_special_tokens,
        adapters=lambda: infer.adapters.served,
        parsers=parsers,
        image_limits=ImageLimits(args.max_images_per_request, args.max_image_bytes, args.max_image_pixels),
        image_urls=ImageUrls(
            args.image_url_fetch,
            args.image_url_allowed_hosts,
            args.image_url_timeout,
            args.max_image_bytes,
            asyncio.get_running_loop(),
        ),
    )
    server = HttpServer(
        infer,
        validation,
        ServerInfo(
            model_id=args.served_model_name or args.model_id,
            model_dtype=shard_info.dtype,
            engine=shard_info.engine,
            limits=limits.validation,
            max_concurrent_requests=args.max_concurrent_requests,
            max_batch_prefill_tokens=limits.max_batch_prefill_tokens,
            max_batch_total_tokens=limits.max_batch_total_tokens,
            max_batch_size=args.max_batch_size,
            num_shard=len(connection.client.urls),
            generation_defaults=validation.defaults.to_json(),
            weight_bytes=shard_info.weight_bytes,
            quantize=shard_info.quantize or None,
            kv_cache_dtype=shard_info.kv_cache_dtype or shard_info.dtype,
            kv_offload_max_bytes=shard_info.kv_offload_max_bytes,
            device=shard_info.device_type,
        ),
        keys=keys,
        payload_limit=args.payload_limit,
        metrics_key=args.metrics_key,
        connections=ConnectionLimits(args.http_idle_timeout, args.http_body_timeout, args.max_connections_per_client),
        tasks=tasks,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    batching = asyncio.create_task(groups.run(), name="batching")
    batching.add_done_callback(lambda _: stop.set())

    grpc_server = None
    if args.grpc_port:
        service = TextGenerationService(infer, server.validation, server.info, keys)
        grpc_server = await grpc_front_door.start(service, args.hostname, args.grpc_port)
    runner = web.AppRunner(
        server.app(), handler_cancellation=True, access_log=None, **server.connections.runner_options()
    )
    await runner.setup()
    ClientCap(runner.server, server.connections.max_per_client)
    await web.TCPSite(runner, args.hostname, args.port).start()
    log.warning("router listening", extra={"url": f"http://{args.hostname}:{args.port}"})
    await stop.wait()

    if batching.done():
        await runner.cleanup()
        batching.result()  # re-raises the loop's crash so the process exits non-zero
        raise RuntimeError("the batching loop stopped")
    await _shut_down(args, server, groups, batching, grpc_server)
    await runner.cleanup()
    for client in groups.clients:
        await client.close()
    log.info("router stopped")


async def _shut_down(args: Config, server: HttpServer, groups: Groups, batching: asyncio.Task, grpc_server) -> None:
    """New requests get 503 (and /health too, so that a load balancer stops sending); those in flight get
    --graceful-termination-timeout to finish, and the rest then end with an error event, so that no client is
    left with a stream cut off mid-way. With the shards down (the launcher is stopping, or gave up restarting
    them) nothing in flight can finish: they end at once."""
    infer = server.infer
    server.draining = True
    timeout = args.graceful_termination_timeout
    log.info("draining", extra={"in_flight": infer.in_flight, "timeout": timeout})
    grpc_stopped = None
    if grpc_server is not None:  # refuses new calls at once, lets the rest finish
        grpc_stopped = asyncio.create_task(grpc_server.stop(grace=timeout + FLUSH_SECONDS))
    await _drain(infer, timeout, until=lambda: groups.recovering)
    batching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await batching
    if infer.in_flight:
        log.warning("ending requests that did not finish in time", extra={"in_flight": infer.in_flight})
        groups.abort("the server stopped before this request finished")
        await _drain(infer, FLUSH_SECONDS)
    if grpc_stopped is not None:
        await grpc_stopped


# Prompt tokens per step while streams decode. Each streaming request waits for the whole mixed step, but a prompt
# read in small chunks costs more in all: SmolLM2-135M on CPU reads a 2,300-token prompt in 1.86 s whole, 1.91 s in
# chunks of 512, 1.98 s of 256 and 2.78 s of 64 (the bare forward), and four such prompts in flight waited a median
# 9.0 s for their first token at 64 against 2.6 s at 512 (benchmarks/long_context.py). 512 is also the GPU's.
DEFAULT_CHUNK_TOKENS = 512


async def connect_groups(
    args: Config, tokenizer, security: Security, store: GroupStore | None, metrics: Metrics
) -> tuple[Connection, Groups]:
    """Every shard group warmed up, one after another (each measures its own KV pool), and a scheduler for each on
    one shared line. Requests are validated against the first group's limits; `store` is the epoch store of a first
    group that spans several nodes."""
    connections: list[Connection] = []
    schedulers: list[Scheduler] = []
    queue, adapters = Queue(), AdapterRegistry()
    for index, address in enumerate(group_addresses(args)):
        group_args = replace(args, shard_address=address)
        group_store = store if index == 0 else None
        connection = await first_connect(group_args, tokenizer, security, group_store)
        if connections:
            check_same_model(connections[0].info, connection.info, address)
        connections.append(connection)

        def reconnect(a=group_args, s=group_store, first=connection) -> Awaitable[Connection]:
            return connect(a, tokenizer, security, s, first)

        schedulers.append(make_scheduler(args, connection, metrics, reconnect, GroupQueue(queue, index), adapters))
    if adapters.served:
        log.warning("lora adapters", extra={"adapters": {a.name: a.weight_bytes for a in adapters.served.values()}})
    placement = placement_for(args.placement, args.placement_max_extra_load)
    if len(schedulers) > 1:
        log.warning("shard groups", extra={"groups": len(schedulers), "placement": args.placement})
    return connections[0], Groups(schedulers, queue, placement, adapters)


def make_scheduler(
    args: Config,
    connection: Connection,
    metrics: Metrics,
    reconnect: Reconnect,
    queue: GroupQueue,
    adapters: AdapterRegistry,
) -> Scheduler:
    info = connection.info
    allocator = BlockAllocator(connection.num_blocks, info.block_size, prefix_caching=args.prefix_caching)
    planner = PlannerConfig(
        max_batch_prefill_tokens=connection.limits.max_batch_prefill_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens or DEFAULT_CHUNK_TOKENS,
        max_batch_size=args.max_batch_size,
        scheduling=args.scheduling,
        static_batch_timeout=args.static_batch_timeout,
        watermark_blocks=allocator.num_blocks // 100,
        max_decode_steps=max(1, args.max_decode_steps),
        speculate=max(0, args.speculate),
        speculate_max_batch=args.speculate_max_batch,
        step_costs=step_costs(connection.calibration),
    )
    adapters.learn(info)  # the shards' --lora-adapters
    return Scheduler(
        connection.client,
        planner,
        allocator,
        metrics,
        reconnect,
        args.max_request_retries,
        adapters,
        queue=queue,
    )


FLUSH_SECONDS = 5.0  # for the handlers of ended requests to send their error events


async def _drain(infer: Infer, timeout: float, until: Callable[[], bool] = lambda: False) -> None:
    """Waits until every in-flight request has finished, the timeout passes, or `until()` holds."""
    deadline = time.monotonic() + timeout
    while infer.in_flight and time.monotonic() < deadline and not until():
        await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    # SIGTERM: its requests in flight end with an error event (their shards died too) rather than cut off.
    lifeline.die_with_launcher(signal.SIGTERM)
    args = config.parse(argv, "Conveyor router: HTTP front end, queue and batching loop.")
    name = args.served_model_name or args.model_id
    model_dir = resolve_model(args.model_id, args.demo_size, args.revision)  # the tokenizer's
    args = replace(args, model_id=str(model_dir), served_model_name=name)
    if any(a.startswith("tcp://") for a in group_addresses(args)) and not args.shard_token:
        raise SystemExit(
            "shards on TCP need the deployment's shared token: set CONVEYOR_SHARD_TOKEN (or --shard-token)"
        )
    conveyor_log.setup("router", args.log_level)
    tracing.setup("conveyor-router", args.otlp_endpoint)
    try:
        asyncio.run(run(args))
    except LimitError as exc:
        log.error("invalid limits: %s", exc)
        sys.exit(1)
    except TaskError as exc:
        log.error("cannot serve --task: %s", exc)
        sys.exit(1)
    except Exception:
        log.exception("router failed")
        sys.exit(1)
    finally:
        tracing.shutdown()
    lifeline.end_cleanly()


if __name__ == "__main__":
    main()
