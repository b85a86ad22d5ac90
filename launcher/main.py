"""`conveyor-launcher`: starts the shards and the router, wires them together, watches them, stops them.

Shards start first, one per rank, each in its own session so that a terminal's Ctrl-C reaches only the
launcher, which then shuts the deployment down in order: the router first (it finishes in-flight requests),
then the shards. A shard that dies takes its group down and the group is restarted (the router replays the
requests it was running), up to --max-restarts within --restart-window; past that, or if the router dies, the
launcher stops the rest and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from conveyor import adapter_sources, config
from conveyor import log as conveyor_log
from conveyor.config import Config
from conveyor.keys import load_keys
from conveyor.launcher import tgi_flags
from conveyor.launcher.processes import ChildDied, Deployment
from conveyor.model_source import resolve_model
from conveyor.shard_channels import AddressError, Security, parse_tcp, rank_address

log = logging.getLogger(__name__)


def check_nodes(args: Config) -> Config:
    """The flags of several nodes, checked before anything starts; a single-node launcher on TCP makes up the
    shared token its router and shards need (every node of several must be given the same one)."""
    if args.num_shard < 1:
        raise SystemExit("--num-shard must be at least 1")
    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    if args.replicas > 1 and args.nnodes > 1:
        raise SystemExit("--replicas > 1 runs whole groups on this machine: not with --nnodes > 1")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise SystemExit(f"--node-rank must be in [0, --nnodes), not {args.node_rank} of {args.nnodes}")
    if args.nnodes > 1 and args.listen is None:
        raise SystemExit("--nnodes > 1: shards must --listen tcp://HOST:PORT where node 0's router can reach them")
    try:
        Security.from_config(args)
        rank_address(args, 0, 0)
    except (AddressError, OSError) as exc:
        raise SystemExit(f"conveyor-launcher: {exc}") from None
    if args.nnodes > 1 and args.advertise_host is None and parse_tcp(args.listen)[0] in ("0.0.0.0", "::"):
        raise SystemExit("--nnodes > 1 with --listen on every interface: say where others reach it, --advertise-host")
    if args.listen is not None and not args.shard_token:
        if args.nnodes > 1:
            raise SystemExit("--nnodes > 1: every node needs the same shared token in CONVEYOR_SHARD_TOKEN")
        args = replace(args, shard_token=secrets.token_urlsafe(32))
    return args


def local_adapters(flag: str | None) -> str | None:
    """`--lora-adapters` with every source a local folder: a Hub id is downloaded here, before any shard starts,
    and a bad value stops the launcher with one line."""
    try:
        pairs = [(name, adapter_sources.resolve(source)) for name, source in adapter_sources.parse(flag)]
    except adapter_sources.AdapterSourceError as exc:
        raise SystemExit(f"conveyor-launcher: {exc}") from None
    return ",".join(f"{name}={path}" for name, path in pairs) or None


def main(argv: list[str] | None = None) -> None:
    # TGI's flags and environment variables (MODEL_ID, PORT, ...) as Conveyor's; one it has no equivalent of stops here.
    argv, hub_environment = tgi_flags.translate(sys.argv[1:] if argv is None else argv, os.environ)
    os.environ.update(hub_environment)
    args = config.parse(
        argv, "Conveyor launcher: serve a model directory, a Hub model or the built-in demo model over HTTP."
    )
    conveyor_log.setup("launcher", args.log_level)
    args = check_nodes(args)
    load_keys(args.api_keys_file, args.api_key)  # a bad keys file stops here, before any shard starts
    # The children read secrets from the environment, which keeps them out of `ps`.
    for name, variable in config.SECRET.items():
        if getattr(args, name):
            os.environ[variable] = getattr(args, name)
    # What every shard and the router get: the same configuration, with the model and the sockets decided.
    # A Hub id is downloaded here, once, before any shard starts; the children get the local snapshot.
    model_dir = resolve_model(args.model_id, args.demo_size, args.revision)
    adapters = local_adapters(args.lora_adapters)  # Hub adapters likewise: fetched once, read from the cache
    # By default the sockets live in a fresh private directory (mode 0700): a predictable path in a shared /tmp
    # would let another local user take the name first, or talk to the shards.
    private_dir = None if args.shard_uds_path else tempfile.mkdtemp(prefix="conveyor-")
    uds_path = args.shard_uds_path or os.path.join(private_dir, "shard")
    name = args.served_model_name or args.model_id
    deployment = Deployment(
        replace(
            args,
            model_id=str(model_dir),
            served_model_name=name,
            revision=None,
            shard_uds_path=uds_path,
            lora_adapters=adapters,
        )
    )
    try:
        _serve(deployment, args, model_dir)
    finally:
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


def _serve(deployment: Deployment, args: Config, model_dir: Path) -> None:
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


def _announce(args: Config, model_dir: Path) -> None:
    if args.node_rank > 0:
        first = args.node_rank * args.num_shard
        print(
            f"\nConveyor node {args.node_rank} of {args.nnodes}: ranks {first}..{first + args.num_shard - 1} of "
            f"{model_dir} joined node 0 ({args.master_addr}:{args.master_port}), whose router serves them\n",
            file=sys.stderr,
            flush=True,
        )
        return
    url = f"http://{args.hostname}:{args.port}"
    body = '{"inputs": "def hello():", "parameters": {"max_new_tokens": 20}}'
    headers = "-H 'Content-Type: application/json'"
    if args.api_key or args.api_keys_file:
        headers += " -H 'Authorization: Bearer <your key>'"
    print(
        f"\nConveyor is serving {model_dir} at {url}{_groups(args)}\n"
        f"Try:\n  curl {url}/generate {headers} -d '{body}'\n"
        f"  curl -N {url}/generate_stream {headers} -d '{body}'\n"
        f"Watch it live: {url}/dashboard\n",
        file=sys.stderr,
        flush=True,
    )


def _groups(args: Config) -> str:
    """How many shard groups serve, when there are several (--replicas, --shard-groups)."""
    count = args.replicas + len(args.other_groups)
    return f" on {count} shard groups" if count > 1 else ""


if __name__ == "__main__":
    main()
