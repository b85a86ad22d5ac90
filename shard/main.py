"""`conveyor-shard`: loads a model directory and serves the Shard gRPC service on a unix socket.

The launcher starts one per rank with RANK and WORLD_SIZE in the environment; the socket is
`{uds_path}-{rank}`, bound only once the model has loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from conveyor import log as conveyor_log
from conveyor.shard.causal_lm import DTYPES, CausalLM
from conveyor.shard.server import serve

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Conveyor shard: one model rank behind gRPC.")
    parser.add_argument("--model-id", required=True, help="a local model directory")
    parser.add_argument("--uds-path", default="/tmp/conveyor-shard", help="socket prefix; rank r binds PREFIX-r")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--log-level", default=None)
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != 1:
        raise SystemExit("the padded engine runs on one rank only; --num-shard > 1 needs the paged engine")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("loading model", extra={"model": args.model_id, "dtype": args.dtype})
    model = await asyncio.to_thread(CausalLM, args.model_id, args.dtype)
    socket_path = f"{args.uds_path}-{rank}"
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    await serve(model, args.uds_path, rank, world_size, stop)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conveyor_log.setup(f"shard-{os.environ.get('RANK', '0')}", args.log_level)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
