"""`conveyor-shard`: loads a model directory and serves the Shard gRPC service on a unix socket.

The launcher starts one per rank with the deployment's flags and RANK and WORLD_SIZE in the environment; the socket is
`{shard_uds_path}-{rank}`, bound only once the model has loaded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import torch
from conveyor.shard.device import choose_device
from conveyor.shard.distributed import initialize
from conveyor.shard.engine import Engine
from conveyor.shard.layers.rotary import UnsupportedRope, frequencies
from conveyor.shard.models.llama import MODEL_TYPES
from conveyor.shard.server import serve

from conveyor import config, tracing
from conveyor import log as conveyor_log
from conveyor.config import Config

log = logging.getLogger(__name__)


def check_supported(model_dir: str) -> None:
    """Refuses, with the reason, a model our Llama-family code does not implement."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in MODEL_TYPES:
        raise SystemExit(
            f"model type {config.model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    try:
        frequencies(config, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    except UnsupportedRope as exc:
        raise SystemExit(f"model {model_dir}: {exc}") from None


def load(args: Config) -> Engine:
    device = choose_device(args.device, int(os.environ.get("RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("device", extra={"device": str(device)})
    group = initialize(device)
    if group.world_size > 1 and device.type == "cpu":
        # Ranks share the machine's cores; more threads than cores each would only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    return Engine(args.model_id, args.dtype, device, group)


async def run(args: Config) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    check_supported(args.model_id)
    log.info("loading model", extra={"model": args.model_id, "dtype": args.dtype})
    engine = await asyncio.to_thread(load, args)
    socket_path = f"{args.shard_uds_path}-{rank}"
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    await serve(engine, args.shard_uds_path, rank, world_size, stop)


def main(argv: list[str] | None = None) -> None:
    args = config.parse(argv, "Conveyor shard: one model rank behind gRPC (rank and world size from RANK, WORLD_SIZE).")
    if args.shard_uds_path is None:
        raise SystemExit("conveyor-shard needs --shard-uds-path")
    conveyor_log.setup(f"shard-{os.environ.get('RANK', '0')}", args.log_level)
    tracing.setup("conveyor-shard", args.otlp_endpoint)
    try:
        asyncio.run(run(args))
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
