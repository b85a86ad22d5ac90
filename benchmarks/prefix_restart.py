"""A shared prefix across a shard restart: time to first token of a long system prompt's next request after the
shard is SIGKILLed, with the prefix cache in memory only and with its disk tier (`--kv-offload-dir`).

    make bench-long                                                  # runs this after long_context.py
    .venv/bin/python -m benchmarks.prefix_restart           # the real model, a 2,000-token prefix

Each deployment is started, sent the prefix with one question (cold: nothing cached) and another (cached in
memory), then its shard is SIGKILLed; once the launcher's new shard serves, two more questions follow: the first
finds the memory cache empty (and, with the disk tier, the prefix's blocks on disk), the second finds it warm again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

from benchmarks import deploy, real_model, recovery
from benchmarks.compare_report import machine, machine_line
from benchmarks.progress import note
from benchmarks.serve import load_tokenizer
from benchmarks.workload import fit_tokens

MODES = {"memory only": False, "disk tier": True}  # with --kv-offload-dir (a fresh folder each run) or without
BLOCK_TOKENS = 16  # the shards' KV block (the unit a file holds)


def ttft_ms(url: str, prompt: str) -> float:
    """Milliseconds to the first streamed token of a greedy completion."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:"):
                return (time.perf_counter() - start) * 1000
    raise RuntimeError("the stream ended without a token")


def shard_pid(port: int) -> int:
    """The shard (rank 0) of the deployment whose launcher serves `port`."""
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "conveyor.launcher.main" in command and str(port) in command:
            return recovery.shard_pid(process.pid, 0)
    raise RuntimeError(f"no launcher serves port {port}")


def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def restarted(url: str, port: int, old: int) -> bool:
    try:
        return shard_pid(port) != old and httpx.get(f"{url}/health", timeout=5).status_code == 200
    except (psutil.Error, RuntimeError, ValueError, httpx.HTTPError):
        return False


def measure(model_dir: Path, folder: Path | None, prefix: str, blocks: int) -> dict[str, float]:
    """TTFTs before and after a SIGKILL of one deployment's shard (its disk tier in `folder`, if any, where the
    prefix's `blocks` full blocks must be before the kill: they are written on a thread of their own)."""
    flags = [] if folder is None else ["--kv-offload-dir", str(folder)]
    with deploy.conveyor(deploy.ConveyorSpec("conveyor", model_dir, flags), 900) as url:
        port = int(url.rsplit(":", 1)[1])
        figures = {"cold_ms": ttft_ms(url, prefix + " Question one?"), "cached_ms": ttft_ms(url, prefix + " Two?")}
        if folder is not None:
            wait(lambda: len(list(folder.glob("*/*.kv"))) >= blocks, 300, "the prefix's blocks on disk")
        old = shard_pid(port)
        os.kill(old, signal.SIGKILL)
        wait(lambda: restarted(url, port, old), 600, "the restarted shard")
        figures["after_restart_ms"] = ttft_ms(url, prefix + " Question three?")
        figures["next_ms"] = ttft_ms(url, prefix + " Question four?")
    return figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="real", help="'real' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--prefix-len", type=int, default=2000, help="the shared system prompt's tokens")
    p.add_argument("--out", type=Path, default=None, help="a JSON file for the figures")
    args = p.parse_args(argv)
    model_dir = real_model.prepare() if args.model_id == "real" else Path(args.model_id)
    prefix, tokens = fit_tokens(load_tokenizer(str(model_dir)), random.Random("prefix-restart"), args.prefix_len)
    blocks = tokens // BLOCK_TOKENS - 1  # the prefix's full blocks (its last may share a block with the question)
    results = {}
    for mode, disk in MODES.items():
        note(f"prefix restart: {mode}")
        with tempfile.TemporaryDirectory(prefix="conveyor-kv-offload-") as folder:
            results[mode] = measure(model_dir, Path(folder) if disk else None, prefix, blocks)
    print(machine_line(machine()))
    print(f"a {args.prefix_len}-token shared prefix, TTFT in ms")
    print(f"{'mode':<12} {'cold':>8} {'cached':>8} {'after SIGKILL':>14} {'next':>8}")
    for mode, f in results.items():
        line = f"{f['cold_ms']:>8.0f} {f['cached_ms']:>8.0f} {f['after_restart_ms']:>14.0f} {f['next_ms']:>8.0f}"
        print(f"{mode:<12} {line}")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "prefix_tokens": args.prefix_len, "modes": results}))


if __name__ == "__main__":
    main()
