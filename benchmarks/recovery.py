"""Recovery time after a shard is killed: seconds from SIGKILL to the first token of a resumed stream.

    .venv/bin/python -m benchmarks.recovery                  # the demo model, 1 and 2 shards, 3 kills each
    .venv/bin/python -m benchmarks.recovery --model-id DIR --shards 1 --kills 1

Each deployment is started with the launcher; for each kill, --streams streams (EOS ignored, long enough to
outlast the recovery) are started, and once every one has a token the last rank is SIGKILLed. The table gives,
per kill, the time until the first resumed stream has a new token and until every stream has one, and checks
that each stream still got all its tokens. The launcher restarts the shard group, the router replays the
requests (docs/operations.md, "Failure and recovery"): the time is mostly the shard processes starting again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from benchmarks import deploy
from benchmarks.progress import note

DEMO = "demo"


@dataclass
class Stream:
    tokens: list[float] = field(default_factory=list)  # arrival time of each token
    error: str | None = None

    def resumed_after(self, moment: float) -> float | None:
        """When the stream's first token after the outage came: the one that ended its longest pause after
        `moment` (tokens already on their way when the shard died still arrive just after it)."""
        later = [t for t in self.tokens if t > moment]
        if not later:
            return None
        gaps = [(b - a, b) for a, b in zip([moment, *later], later)]
        return max(gaps)[1]


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict, stream: Stream) -> None:
    async with session.post(f"{url}/generate_stream", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                stream.error = event["error"]
                return
            stream.tokens.append(time.monotonic())


def shard_pid(launcher_pid: int, rank: int) -> int:
    for child in psutil.Process(launcher_pid).children():
        if "conveyor.shard.main" in " ".join(child.cmdline()) and child.environ().get("RANK") == str(rank):
            return child.pid
    raise RuntimeError(f"no shard of rank {rank} under the launcher")


async def one_kill(url: str, launcher_pid: int, rank: int, args: argparse.Namespace) -> dict[str, float]:
    """Seconds from the SIGKILL to the first resumed token: of the quickest stream, and of the slowest."""
    streams = [Stream() for _ in range(args.streams)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        bodies = [
            {"inputs": f"def stream_{n}():", "parameters": {"max_new_tokens": args.max_new_tokens, "ignore_eos": True}}
            for n in range(args.streams)
        ]
        tasks = [asyncio.create_task(read_stream(session, url, b, s)) for b, s in zip(bodies, streams)]
        while not all(s.tokens or s.error for s in streams):
            await asyncio.sleep(0.01)
        killed_at = time.monotonic()
        os.kill(shard_pid(launcher_pid, rank), signal.SIGKILL)
        await asyncio.gather(*tasks)
    resumed = [s.resumed_after(killed_at) for s in streams]
    if any(s.error or len(s.tokens) != args.max_new_tokens for s in streams) or None in resumed:
        raise RuntimeError(f"a stream did not complete: {[s.error for s in streams if s.error]}")
    return {"first": min(resumed) - killed_at, "all": max(resumed) - killed_at}


def measure(args: argparse.Namespace, num_shard: int) -> list[dict[str, float]]:
    port, master_port = deploy.free_ports(2)
    command = deploy.launcher_command(args.model_id, port, master_port, ["--num-shard", str(num_shard)])
    url, results = f"http://127.0.0.1:{port}", []
    with tempfile.NamedTemporaryFile(prefix="conveyor-recovery-", suffix=".log", delete=False) as log:
        note(f"starting {num_shard} shard(s) on port {port} (output: {log.name})")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deploy.wait_healthy(process, url, args.startup_timeout, Path(log.name))
        for kill in range(args.kills):
            result = asyncio.run(one_kill(url, process.pid, num_shard - 1, args))
            note(f"  kill {kill + 1}: first resumed token after {result['first']:.2f} s")
            results.append(result)
            deploy.wait_healthy(process, url, args.startup_timeout, Path(log.name))
    finally:
        deploy.stop(process)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEMO)
    parser.add_argument("--shards", default="1,2", help="shard counts, comma-separated")
    parser.add_argument("--kills", type=int, default=3, help="kills per deployment")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    print(f"{'shards':>6}  {'kills':>5}  {'first resumed token (s)':>24}  {'every stream resumed (s)':>25}")
    for num_shard in (int(n) for n in args.shards.split(",")):
        results = measure(args, num_shard)
        first = [r["first"] for r in results]
        every = [r["all"] for r in results]
        print(
            f"{num_shard:>6}  {len(results):>5}  {_summary(first):>24}  {_summary(every):>25}",
            flush=True,
        )


def _summary(values: list[float]) -> str:
    """Median, with the range when there are several."""
    median = statistics.median(values)
    return f"{median:.2f}" if len(values) == 1 else f"{median:.2f} ({min(values):.2f}-{max(values):.2f})"


if __name__ == "__main__":
    main()
