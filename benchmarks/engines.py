"""Padded vs paged engine, 1 vs 2 shards, at several numbers of concurrent streams: one run, one prompt set.

    .venv/bin/python benchmarks/engines.py                  # the demo model, the full grid (many minutes on CPU)
    .venv/bin/python benchmarks/engines.py --model-id DIR --concurrency 1,8 --requests 8

Each deployment is started with the launcher, warmed up, measured at every concurrency with the same seeded
prompts (every request streams exactly --max-new-tokens tokens, EOS ignored), then stopped, so the rows differ
only in the engine and the number of shards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streams import Row, free_port, prompts, run_level  # noqa: E402  (a sibling script, not a package)


def start(model_id: str, engine: str, shards: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "conveyor.launcher.main", "--model-id", model_id, "--port", str(port),
               "--engine", engine, "--num-shard", str(shards), "--master-port", str(free_port()), *extra]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{engine} x{shards}: the launcher exited with {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{engine} x{shards}: not healthy after 900 s")


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(120)


def measure(args: argparse.Namespace, engine: str, shards: int, texts: list[str]) -> list[Row]:
    print(f"starting {engine} engine with {shards} shard(s)...", file=sys.stderr, flush=True)
    extra = list(args.launcher_arg)
    if args.max_batch_total_tokens:
        extra += ["--max-batch-total-tokens", str(args.max_batch_total_tokens)]
    process, url = start(args.model_id, engine, shards, extra)
    try:
        asyncio.run(run_level(url, texts[:4], 4, 4))  # warm-up
        rows = []
        for c in args.concurrency:
            print(f"  {len(texts)} requests, {c} at a time...", file=sys.stderr, flush=True)
            rows.append(asyncio.run(run_level(url, texts, c, args.max_new_tokens)))
        return rows
    finally:
        stop(process)


def print_table(results: dict[tuple[str, int], list[Row] | None], concurrency: list[int]) -> None:
    header = f"{'engine':>8} {'shards':>6} " + " ".join(f"{f'{c} streams':>12}" for c in concurrency)
    print("\noutput tok/s\n" + header)
    for (engine, shards), rows in results.items():
        cells = [f"{r.tok_per_s:>12.1f}" for r in rows] if rows else [f"{'n/a':>12}"] * len(concurrency)
        print(f"{engine:>8} {shards:>6} " + " ".join(cells))
    paged, padded = results.get(("paged", 1)), results.get(("padded", 1))
    if paged and padded:
        print(f"{'paged/padded':>15} " + " ".join(f"{p.tok_per_s / q.tok_per_s:>11.2f}x" for p, q in zip(paged, padded)))


def main(argv: list[str] | None = None) -> None:
    def numbers(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="demo")
    p.add_argument("--engines", default="padded,paged", type=lambda s: s.split(","))
    p.add_argument("--shards", default="1,2", type=numbers)
    p.add_argument("--concurrency", default="1,8,32", type=numbers)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--min-words", type=int, default=10)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-total-tokens", type=int, default=None)
    p.add_argument("--launcher-arg", action="append", default=[], help="passed to the launcher (repeatable)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = p.parse_args(argv)

    texts = prompts(args.requests, args.seed, args.min_words, args.max_words)
    print(f"model {args.model_id}; {args.requests} prompts of {args.min_words}-{args.max_words} words (seed "
          f"{args.seed}); {args.max_new_tokens} new tokens each")  # fmt: skip
    results: dict[tuple[str, int], list[Row] | None] = {}
    for engine in args.engines:
        for shards in args.shards:
            padded_multi = engine == "padded" and shards > 1  # the padded engine runs on one rank only
            results[(engine, shards)] = None if padded_multi else measure(args, engine, shards, texts)
    print_table(results, args.concurrency)
    if args.json:
        raw = {f"{e}x{s}": [vars(r) for r in rows] if rows else None for (e, s), rows in results.items()}
        args.json.write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
