"""`conveyor-shard`: loads a model directory and serves the Shard gRPC service, on a unix socket or on TCP.

The launcher starts one per rank with the deployment's flags and RANK, WORLD_SIZE and LOCAL_RANK in the
environment; the address (conveyor/shard_channels.py) is bound only once the model has loaded and the group has
formed, so a shard that answers is ready.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path

import torch

from conveyor import adapter_sources, config, lifeline, tracing
from conveyor import log as conveyor_log
from conveyor.config import Config
from conveyor.cpu import threads_per_rank, usable_cores
from conveyor.model_source import resolve_model
from conveyor.shard.adapters.adapter_files import AdapterError
from conveyor.shard.layers.kv_quant import KVCacheUnavailable
from conveyor.shard.layers.quantize import QuantizationUnavailable
from conveyor.shard.layers.rotary import UnsupportedRope, frequencies
from conveyor.shard.models import MODEL_TYPES, language_config
from conveyor.shard.runtime.device import choose_device
from conveyor.shard.runtime.process_group import ProcessGroup, initialize
from conveyor.shard.service.grpc_service import serve
from conveyor.shard.service.torch_thread import TorchThread
from conveyor.shard.step.engine import Engine
from conveyor.shard.step.loading import Draft
from conveyor.shard_channels import AddressError, Security, rank_address

log = logging.getLogger(__name__)


def check_supported(model_dir: str) -> None:
    """Refuses, with the reason, a model our Llama-family code does not implement."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in MODEL_TYPES:
        raise SystemExit(
            f"model type {config.model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    config = language_config(config)
    try:
        frequencies(config, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    except UnsupportedRope as exc:
        raise SystemExit(f"model {model_dir}: {exc}") from None


def load(args: Config, served_name: str | None = None) -> Engine:
    """The engine for this rank, with its start-time adapters; `served_name`: --model-id as given (before a Hub id
    became a snapshot folder), which an adapter's base model must name."""
    device = choose_device(args.device, _device_index())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("device", extra={"device": str(device)})
    group = initialize(device, args.startup_timeout)
    # Ranks on one machine share its cores, with every group's (--replicas); more threads than cores would thrash.
    local_ranks = _local_world_size(group) * args.replicas
    if device.type == "cpu" and (threads := threads_per_rank(local_ranks, usable_cores())) is not None:
        torch.set_num_threads(threads)
    try:
        draft = Draft(args.speculate_model, args.speculate_quantize) if args.speculate_model else None
        adapters = adapter_sources.parse(args.lora_adapters)
        return Engine(
            args.model_id,
            args.dtype,
            device,
            group,
            args.quantize,
            draft,
            adapters=adapters,
            max_loras=args.max_loras,
            model_name=served_name,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_offload=_offload(args),
        )
    except (QuantizationUnavailable, KVCacheUnavailable, AdapterError, adapter_sources.AdapterSourceError) as exc:
        raise SystemExit(f"conveyor-shard: {exc}") from None


def _offload(args: Config) -> tuple[Path, int] | None:
    """--kv-offload-dir and its cap in bytes, or None without the flag."""
    if not args.kv_offload_dir:
        return None
    return Path(args.kv_offload_dir), int(args.kv_offload_max_gb * 2**30)


def _local_world_size(group: ProcessGroup) -> int:
    """The ranks on this node (the launcher and torchrun set LOCAL_WORLD_SIZE; without it, the whole group)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", group.world_size))


def _device_index() -> int:
    """This rank's GPU on its node: its local rank, after the GPUs of the groups before its own (--replicas; the
    launcher sets the offset)."""
    return int(os.environ.get("CONVEYOR_DEVICE_OFFSET", "0")) + _local_rank()


def _local_rank() -> int:
    """This rank's place on its own node (its GPU), as the launcher or torchrun sets it."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


async def run(args: Config, security: Security, served_name: str | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    check_supported(args.model_id)
    log.info("loading model", extra={"model": args.model_id, "dtype": args.dtype})
    torch_thread = TorchThread()  # loads the model and runs every step: one OpenMP team (service/torch_thread.py)
    engine = await torch_thread.run(load, args, served_name)
    address = rank_address(args, engine.group.rank, _local_rank())
    if address.bind.startswith("unix://") and os.path.exists(path := address.bind.removeprefix("unix://")):
        os.unlink(path)
    urls = await asyncio.to_thread(engine.group.gather, address.url)  # every rank's, for ServiceDiscovery
    await serve(engine, torch_thread, address.bind, urls, security, stop)
    if engine.offload is not None:  # a clean stop writes the blocks still queued for the disk tier
        await asyncio.to_thread(engine.offload.tier.close)


def main(argv: list[str] | None = None) -> None:
    lifeline.die_with_launcher(signal.SIGKILL)  # a hung forward would outlive anything gentler
    args = config.parse(
        argv, "Conveyor shard: one model rank behind gRPC (rank and world size from RANK, WORLD_SIZE, LOCAL_RANK)."
    )
    if args.listen is None and args.shard_uds_path is None:
        raise SystemExit("conveyor-shard needs --listen tcp://HOST:PORT or --shard-uds-path")
    if args.listen is not None and not args.shard_token:
        raise SystemExit(
            "a shard on TCP needs the deployment's shared token: set CONVEYOR_SHARD_TOKEN (or --shard-token)"
        )
    try:
        security = Security.from_config(args)
        rank_address(args, 0, 0)
    except (AddressError, OSError) as exc:
        raise SystemExit(f"conveyor-shard: {exc}") from None
    served_name = args.model_id
    args = replace(args, model_id=str(resolve_model(args.model_id, args.demo_size, args.revision)))
    if args.speculate_model not in (None, "self"):
        args = replace(args, speculate_model=str(resolve_model(args.speculate_model, args.demo_size, None)))
    conveyor_log.setup(f"shard-{os.environ.get('RANK', '0')}", args.log_level)
    tracing.setup("conveyor-shard", args.otlp_endpoint)
    try:
        asyncio.run(run(args, security, served_name))
    finally:
        tracing.shutdown()
    lifeline.end_cleanly()


if __name__ == "__main__":
    main()
