"""Reaching warmed-up shards: at startup, and again each time the shard group has been restarted.

The order is TGI's: discover every rank from rank 0, clear their caches, read `Info`, run `Warmup` with the
largest prefill the limits allow (which sizes the KV pool), and only then serve.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from conveyor.config import Config
from conveyor.group_store import GroupStore
from conveyor.router.limits import ResolvedLimits, resolve_limits
from conveyor.router.pipeline.request import Parameters
from conveyor.router.transport.records import Batch, Calibration, NewRequest, ShardInfo, Warmed, Warmup
from conveyor.router.transport.shard_client import ShardedClient, ShardError
from conveyor.shard_channels import Security

log = logging.getLogger(__name__)


@dataclass
class Connection:
    client: ShardedClient
    info: ShardInfo  # rank 0's
    limits: ResolvedLimits  # with the KV capacity the warmup measured
    calibration: Calibration | None = None  # a decode step's seconds by rows, when drafts are on (the first warmup's)

    @property
    def num_blocks(self) -> int:
        return self.limits.max_batch_total_tokens // self.info.block_size


def shard_address(args: Config) -> str:
    """Where the router finds rank 0: --shard-address, or the socket of a launcher's rank 0."""
    if args.shard_address:
        return args.shard_address
    if args.shard_uds_path:
        return f"unix://{args.shard_uds_path}-0"
    raise SystemExit("conveyor-router needs --shard-address (or --shard-uds-path)")


def group_addresses(args: Config) -> list[str]:
    """Each shard group's address, as `shard_address` names one: the first group's, then --shard-groups."""
    return [shard_address(args), *args.other_groups]


# What every shard group must share with the first: a request validated against the first group's limits may be
# placed on any of them, and must get the same answer there.
SAME_MODEL = ("model_type", "dtype", "quantize", "kv_cache_dtype", "max_position_embeddings", "device_type")


def check_same_model(first: ShardInfo, other: ShardInfo, address: str) -> None:
    """Refuses a shard group that serves another model, or the same one otherwise, than the first group."""
    differ = [
        f"{name} {getattr(other, name)!r} (the first group: {getattr(first, name)!r})"
        for name in SAME_MODEL
        if getattr(other, name) != getattr(first, name)
    ]
    if differ:
        raise ValueError(f"the shard group at {address} serves another model than the first: {', '.join(differ)}")


async def first_connect(args: Config, tokenizer, security: Security, group: GroupStore | None = None) -> Connection:
    """The first connection, tried until --startup-timeout: a router started on its own (another container,
    another host) may come up before its shards do, and the launcher starts it beside them."""
    deadline = time.monotonic() + args.startup_timeout
    pause = FIRST_CONNECT_SECONDS
    while True:
        try:
            return await connect(args, tokenizer, security, group)
        except ShardError as exc:  # shards not answering yet; wrong limits and the like fail at once
            if time.monotonic() > deadline:
                raise
            log.info("shards not ready yet", extra={"error": str(exc)})
            await asyncio.sleep(pause)
            pause = min(pause * 2, MOST_CONNECT_SECONDS)


# The pause between tries grows from the first to the most: shards that answer soon are reached soon (a start
# waited half a pause on average at a fixed 0.5 s), and ones that load for long are not asked 20 times a second.
FIRST_CONNECT_SECONDS = 0.05
MOST_CONNECT_SECONDS = 0.5


def _check_ranks(urls: list[str], infos: list[ShardInfo]) -> None:
    """Each address must lead to the rank of its place, and to a group of their number."""
    for place, (url, info) in enumerate(zip(urls, infos)):
        if info.rank != place or info.world_size != len(urls):
            raise ValueError(
                f"{url} answers as rank {info.rank} of {info.world_size}, not rank {place} of {len(urls)} "
                "(check --advertise-host and --shard-address)"
            )


async def connect(
    args: Config, tokenizer, security: Security, group: GroupStore | None = None, first: Connection | None = None
) -> Connection:
    """A client to every rank, warmed up. On a reconnection, `first` is the first connection: its limits (which
    requests were validated against) and its step deadline stay, and the warmup is a short one that asks for
    the pool the first one measured (the capacity must still hold the longest request). `group` is the epoch
    store of a group that spans several nodes: a hung one is restarted through it."""
    client = await ShardedClient.connect(shard_address(args), security)
    if group is not None:
        epoch = group.epoch  # the group this client talks to: restarting moves the epoch on from it, once
        client.restart_group = lambda: group.restart(epoch)
    try:
        await client.clear_cache()
        infos = await client.infos()
        _check_ranks(client.urls, infos)
        client.pids, client.instances = [info.pid for info in infos], [info.instance for info in infos]
        limits = first.limits if first else resolve_limits(args, infos[0].max_position_embeddings, tokenizer)
        log.info("warming up", extra={"max_batch_prefill_tokens": limits.max_batch_prefill_tokens})
        request = warmup(limits, tokenizer, again=first is not None)
        # The shards hold steps to the deadline too (their health says when one is past it): one deadline for all,
        # the flag's, the first connection's, or the one the shards choose from their warmup.
        request.step_timeout = first.client.step_timeout if first else args.shard_step_timeout or 0.0
        measured = args.speculate_policy == "measured"
        request.calibrate_rows = (
            () if first or not measured else calibration_rows(args.speculate, args.speculate_max_batch)
        )
        warmed = await client.warmup(request, timeout=args.startup_timeout)
        client.step_timeout = warmed.step_timeout
        calibration = first.calibration if first else _calibration(request.calibrate_rows, warmed)
        return Connection(client, infos[0], limits.with_capacity(warmed.capacity), calibration)
    except BaseException:
        await client.close()
        raise


CALIBRATE_MOST_ROWS = 64  # the largest step timed at warmup; a larger drafting step's cost is extrapolated


def calibration_rows(speculate: int, max_batch: int) -> tuple[int, ...]:
    """Where the draft choice needs a step's cost: every row count of one sequence's verify step (1 to
    `speculate` + 1, where kernels switch row blocking), and a few points up to the largest drafting batch's,
    between which the cost is near linear. None with drafts off."""
    if speculate <= 0:
        return ()
    most = min(CALIBRATE_MOST_ROWS, max(1, max_batch) * (speculate + 1))
    return tuple(sorted({*range(1, min(speculate + 1, most) + 1), most // 2, most} - {0}))


def _calibration(rows: tuple[int, ...], warmed: Warmed) -> Calibration | None:
    if not rows:
        return None
    if len(warmed.step_seconds) != len(rows) or min(warmed.step_seconds) <= 0:
        log.warning("no step costs from warmup: every request may have its full drafts")
        return None
    seconds = warmed.step_seconds
    log.info("step costs", extra={"rows": list(rows), "vs_one_row": [round(s / seconds[0], 3) for s in seconds]})
    return Calibration(rows, seconds, warmed.draft_step_seconds)


def warmup(limits: ResolvedLimits, tokenizer, again: bool = False) -> Warmup:
    """As many longest prompts as the prefill budget admits, each asking for two new tokens. `again`, after the
    shards restarted: one short prompt, and the pool asked for at the size the first warmup measured (the
    largest prefill takes many seconds on a CPU, and every stream waits for it)."""
    max_input = min(16, limits.validation.max_input_tokens) if again else limits.validation.max_input_tokens
    count = 1 if again else max(1, limits.max_batch_prefill_tokens // max_input)
    token = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[0]
    parameters = Parameters(max_new_tokens=2, ignore_eos=True)  # greedy, every sampling parameter at its default
    requests = [NewRequest(id=n, input_ids=[token] * max_input, parameters=parameters) for n in range(count)]
    return Warmup(
        batch=Batch(id=0, requests=requests),
        max_batch_total_tokens=limits.max_batch_total_tokens if again else limits.user_batch_total_tokens or 0,
    )
