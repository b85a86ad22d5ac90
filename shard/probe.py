"""`python -m conveyor.shard.probe URL`: a health check for a shard that no launcher supervises (a container of
its own, a pod): exit 0 when it answers SERVING on the standard gRPC health service, 1 otherwise.

A shard is NOT_SERVING when a step has run past its deadline (shard/service/watchdog.py): its forward is stuck and
only a restart helps. `--stuck-only` fails on that alone, not on a shard that is still loading or being restarted (for
a liveness probe, which must not kill what is merely slow to start); `--kill-if-stuck` also SIGKILLs it, for
supervisors that restart what exits but not what fails its health check (Docker Compose). The process id comes
from the shard's own Info, which needs the shared token on TCP (CONVEYOR_SHARD_TOKEN, as the shard has it).
Plain TCP and unix sockets only: with --shard-tls-* probe the port with a TCP connect instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.config import SECRET
from conveyor.shard_channels import Security
from conveyor.v1 import shard_pb2 as pb
from conveyor.v1 import shard_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def status(url: str, security: Security, timeout: float) -> int | None:
    """The shard's health status, or None if it did not answer."""
    with security.channel(url) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError:
            return None


def kill(url: str, security: Security, timeout: float) -> int:
    """SIGKILLs the shard at `url` (by the process id its Info names); returns that id."""
    with security.channel(url) as channel:
        info = pb_grpc.ShardStub(channel).Info(pb.InfoRequest(), timeout=timeout, metadata=security.metadata())
    os.kill(info.pid, signal.SIGKILL)
    return info.pid


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m conveyor.shard.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the shard's address: tcp://HOST:PORT or unix:///PATH")
    parser.add_argument("--stuck-only", action="store_true", help="fail only when the shard says it is stuck")
    parser.add_argument("--kill-if-stuck", action="store_true", help="SIGKILL a shard that says it is stuck")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for each answer")
    args = parser.parse_args(argv)
    security = Security(token=os.environ.get(SECRET["shard_token"]) or None)
    answer = status(args.url, security, args.timeout)
    if answer == NOT_SERVING:
        print(f"{args.url}: NOT_SERVING (a step is past its deadline)", file=sys.stderr)
        if args.kill_if_stuck:
            print(f"{args.url}: killed process {kill(args.url, security, args.timeout)}", file=sys.stderr)
        sys.exit(1)
    if answer != SERVING and not args.stuck_only:
        print(f"{args.url}: {'no answer' if answer is None else 'not serving'}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
