"""`conveyor-launcher`: starts the shards and the router, wires them together, watches them, stops them.

Shards start first, one per rank, each in its own session so that a terminal's Ctrl-C reaches only the
launcher, which then shuts the deployment down in order: the router first (it finishes in-flight requests),
then the shards. If any child dies on its own, the launcher stops the rest and exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from conveyor import log as conveyor_log
from conveyor.launcher import demo_model
from conveyor.launcher.processes import ChildDied, Deployment

log = logging.getLogger(__name__)

DEMO_MODEL = "demo"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Conveyor launcher: serve a model directory (or the built-in demo model) over HTTP."
    )
    p.add_argument("--model-id", default=DEMO_MODEL, help="a local model directory, or 'demo' (built on first use)")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC front door on this port")
    p.add_argument("--num-shard", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the shards run: auto takes one GPU per rank when GPUs are visible, else the CPU")
    p.add_argument("--max-concurrent-requests", type=int, default=128)
    p.add_argument("--max-input-tokens", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-batch-prefill-tokens", type=int, default=None)
    p.add_argument("--max-batch-total-tokens", type=int, default=None)
    p.add_argument("--waiting-served-ratio", type=float, default=0.3)
    p.add_argument("--max-waiting-tokens", type=int, default=20)
    p.add_argument("--max-batch-size", type=int, default=None)
    p.add_argument("--scheduling", choices=["continuous", "static", "sequential"], default="continuous",
                   help="paged engine: continuous batching (default), static batches run to completion (waiting "
                        "for --max-batch-size requests or --static-batch-timeout), or one request at a time")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="paged engine: prompt tokens per step while streams are decoding (default: 64 on CPU, "
                        "512 on GPU)")
    p.add_argument("--static-batch-timeout", type=float, default=1.0, help="seconds a static batch waits to fill")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="paged engine: reuse the KV blocks of cached prompt prefixes (default on)")
    p.add_argument("--max-stop-sequences", type=int, default=4)
    p.add_argument("--max-top-n-tokens", type=int, default=5)
    p.add_argument("--shard-uds-path", default=None, help="socket prefix for the shards (default: a private temp path)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for shards and router")
    p.add_argument("--graceful-termination-timeout", type=float, default=60.0)
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans of router and shards there")
    p.add_argument("--api-key", default=None, help="required as a Bearer token on POST routes (or CONVEYOR_API_KEY)")
    p.add_argument("--payload-limit", type=int, default=2_000_000, help="largest request body in bytes")
    p.add_argument("--demo-size", choices=sorted(demo_model.SIZES), default="small")
    p.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default; or CONVEYOR_LOG_LEVEL)")
    return p.parse_args(argv)


def resolve_model(model_id: str, demo_size: str) -> Path:
    """A model directory; 'demo' is built into the cache folder the first time it is asked for."""
    if model_id == DEMO_MODEL:
        cache = Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))
        target = cache / f"demo-{demo_size}"
        if not (target / "conveyor_demo.json").exists():
            print(f"building the {demo_size} demo model into {target} (first use only)...", file=sys.stderr)
        return demo_model.ensure(target, demo_size)
    path = Path(model_id)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model-id {model_id!r}: no config.json there (Conveyor loads local model directories)")
    return path


def router_args(args: argparse.Namespace, model_dir: Path, uds_path: str) -> list[str]:
    forwarded = [
        "--hostname", args.hostname, "--port", str(args.port),
        "--max-concurrent-requests", str(args.max_concurrent_requests),
        "--waiting-served-ratio", str(args.waiting_served_ratio),
        "--max-waiting-tokens", str(args.max_waiting_tokens),
        "--max-stop-sequences", str(args.max_stop_sequences),
        "--max-top-n-tokens", str(args.max_top_n_tokens),
        "--graceful-termination-timeout", str(args.graceful_termination_timeout),
        "--payload-limit", str(args.payload_limit),
        "--scheduling", args.scheduling, "--static-batch-timeout", str(args.static_batch_timeout),
        "--prefix-caching" if args.prefix_caching else "--no-prefix-caching",
    ]  # fmt: skip
    for name in ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens",
                 "max_batch_total_tokens", "max_batch_size", "grpc_port", "prefill_chunk_tokens"):  # fmt: skip
        if (value := getattr(args, name)) is not None:
            forwarded += ["--" + name.replace("_", "-"), str(value)]
    if args.log_level:
        forwarded += ["--log-level", args.log_level]
    if args.otlp_endpoint:
        forwarded += ["--otlp-endpoint", args.otlp_endpoint]
    return ["--model-id", str(model_dir), "--master-shard-uds-path", f"{uds_path}-0", *forwarded]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    conveyor_log.setup("launcher", args.log_level)
    if args.num_shard < 1:
        raise SystemExit("--num-shard must be at least 1")
    model_dir = resolve_model(args.model_id, args.demo_size)
    if args.api_key:
        os.environ["CONVEYOR_API_KEY"] = args.api_key  # the router reads it; the environment keeps it out of `ps`
    uds_path = args.shard_uds_path or os.path.join(tempfile.gettempdir(), f"conveyor-{os.getpid()}")
    deployment = Deployment(
        model_dir=model_dir,
        num_shard=args.num_shard,
        dtype=args.dtype,
        device=args.device,
        uds_path=uds_path,
        master_addr=args.master_addr,
        master_port=args.master_port,
        router_args=router_args(args, model_dir, uds_path),
        router_url=f"http://{args.hostname}:{args.port}",
        log_level=args.log_level,
        otlp_endpoint=args.otlp_endpoint,
    )
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        deployment.start(args.startup_timeout, should_stop=lambda: stopping)
        if not stopping:
            _announce(args, model_dir)
            deployment.watch(should_stop=lambda: stopping)
    except ChildDied as exc:
        print(f"conveyor-launcher: {exc}; stopping everything", file=sys.stderr)
        deployment.stop(args.graceful_termination_timeout)
        sys.exit(1)
    deployment.stop(args.graceful_termination_timeout + 5)


def _announce(args: argparse.Namespace, model_dir: Path) -> None:
    url = f"http://{args.hostname}:{args.port}"
    body = '{"inputs": "def hello():", "parameters": {"max_new_tokens": 20}}'
    print(
        f"\nConveyor is serving {model_dir} at {url}\n"
        f"Try:\n  curl {url}/generate -H 'Content-Type: application/json' -d '{body}'\n"
        f"  curl -N {url}/generate_stream -H 'Content-Type: application/json' -d '{body}'\n",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    main()
