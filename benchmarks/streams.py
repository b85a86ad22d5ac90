"""Output tokens per second at different numbers of concurrent streaming clients, measured in one run.

    .venv/bin/python benchmarks/streams.py                       # starts the demo model itself
    .venv/bin/python benchmarks/streams.py --url http://127.0.0.1:3000 --concurrency 1,8,32

The same seeded prompt set is sent at each concurrency (at most C requests in flight), every request streaming
exactly --max-new-tokens tokens (EOS ignored), so the rows differ only in how many streams share the batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp

WORDS = (
    "def class return import self value data list dict for while if else print yield lambda "
    "async await with open range len str int float None True False try except raise"
).split()


def prompts(count: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


@dataclass
class RequestResult:
    tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)


@dataclass
class Row:
    concurrency: int
    requests: int
    output_tokens: int
    wall: float
    ttft_p50: float
    itl_p50: float

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, max_new_tokens: int) -> RequestResult:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    result, start = RequestResult(), time.perf_counter()
    last = start
    async with session.post(f"{url}/generate_stream", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(event["error"])
            now = time.perf_counter()
            if result.tokens == 0:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last, result.tokens = now, result.tokens + 1
    return result


async def run_level(url: str, texts: list[str], concurrency: int, max_new_tokens: int) -> Row:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded(text: str) -> RequestResult:
            async with limit:
                return await one_request(session, url, text, max_new_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(t) for t in texts))
        wall = time.perf_counter() - start
    itls = [x for r in results for x in r.itls] or [0.0]
    return Row(
        concurrency,
        len(results),
        sum(r.tokens for r in results),
        wall,
        statistics.median(r.ttft for r in results),
        statistics.median(itls),
    )


def print_table(rows: list[Row]) -> None:
    base = rows[0].tok_per_s
    print(
        f"\n{'streams':>7} {'requests':>8} {'out tokens':>10} {'wall s':>8} {'out tok/s':>10} "
        f"{'vs first':>8} {'TTFT p50 ms':>11} {'ITL p50 ms':>10}"
    )
    for r in rows:
        print(
            f"{r.concurrency:>7} {r.requests:>8} {r.output_tokens:>10} {r.wall:>8.1f} {r.tok_per_s:>10.1f} "
            f"{r.tok_per_s / base:>7.1f}x {r.ttft_p50 * 1000:>11.0f} {r.itl_p50 * 1000:>10.0f}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_demo_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "conveyor.launcher.main", "--model-id", "demo", "--port", str(port)]
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("the launcher exited while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit("the server did not become healthy")


async def main_async(args: argparse.Namespace) -> list[Row]:
    texts = prompts(args.requests, args.seed, args.min_words, args.max_words)
    print(f"warming up with {min(4, len(texts))} requests...", file=sys.stderr)
    await run_level(args.url, texts[:4], 4, 4)
    rows = []
    for c in args.concurrency:
        print(f"{len(texts)} requests, {c} at a time...", file=sys.stderr, flush=True)
        rows.append(await run_level(args.url, texts, c, args.max_new_tokens))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server; default: start the demo model on --port")
    p.add_argument("--port", type=int, default=3999)
    p.add_argument("--concurrency", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--min-words", type=int, default=10)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    server = None
    if args.url is None:
        server = start_demo_server(args.port)
        args.url = f"http://127.0.0.1:{args.port}"
    try:
        print_table(asyncio.run(main_async(args)))
    finally:
        if server is not None:
            server.terminate()
            server.wait(120)


if __name__ == "__main__":
    main()
