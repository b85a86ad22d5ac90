"""The bare-forward ceiling: the same workload through the same model in a plain torch loop, with no server.

The paged model is loaded in-process as a shard loads it, and the workload's prompts run with at most `batch`
sequences at once: whenever rows finish, waiting prompts join the next forward whole (up to a prefill token
budget), and every forward is one flat pass over one new token per decoding row plus the joining prompts, with
the greedy choice (the sampler's `greedy`, the fastest way here to pick a token). That is continuous batching
with nothing around it (no HTTP, router, gRPC, sampler or detokenizer), so `server tok/s / bare tok/s` is what the
serving layers keep. Steps at a full batch with no prompt joining are also timed alone: the pure decode rate at
that batch size.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.progress import note


@dataclass
class BareResult:
    batch: int
    requests: int
    input_tokens: int
    output_tokens: int
    duration_s: float
    steps: int
    full_decode_steps: int
    median_full_decode_step_ms: float | None

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def decode_throughput(self) -> float | None:
        """Tokens per second of decode-only steps at the full batch size."""
        step = self.median_full_decode_step_ms
        return self.batch * 1000.0 / step if step else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "duration_s": self.duration_s,
            "steps": self.steps,
            "output_throughput": self.output_throughput,
            "full_decode_steps": self.full_decode_steps,
            "median_full_decode_step_ms": self.median_full_decode_step_ms,
            "decode_throughput": self.decode_throughput,
        }


@dataclass
class _Row:
    slot: int
    length: int  # tokens already in the cache
    feed: list[int]  # tokens this forward feeds: the whole prompt when joining, then one token
    remaining: int  # tokens still to generate


class BareLoop:
    def __init__(
        self, model_dir: Path, batch: int, dtype: str = "float32", quantize: str | None = None, device: str = "cpu"
    ) -> None:
        from conveyor.shard import offline

        self.engine = offline.load(model_dir, dtype, quantize, device=device)
        self.block_size, self.batch = self.engine.block_size, batch
        self.blocks_per_slot = 0
        self.cache = None

    def allocate(self, max_len: int) -> None:
        """A KV pool of `batch` slots of `max_len` tokens each: a row owns its slot's blocks while it runs."""
        self.blocks_per_slot = math.ceil(max_len / self.block_size)
        self.cache = self.engine.allocate(self.batch * self.blocks_per_slot)

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenizer(text).input_ids

    def table(self, slot: int) -> list[int]:
        return list(range(slot * self.blocks_per_slot, (slot + 1) * self.blocks_per_slot))

    @torch.inference_mode()
    def forward(self, rows: list[_Row]) -> list[int]:
        """One flat forward over every row's fed tokens; returns each row's greedy next token."""
        from conveyor.shard import offline

        last = torch.cumsum(torch.tensor([len(r.feed) for r in rows]), 0) - 1
        flat = [(r.feed, self.table(r.slot), r.length) for r in rows]
        return offline.greedy(offline.forward(self.engine, self.cache, flat, last))[0].tolist()

    def run(self, requests: list[tuple[list[int], int]], prefill_budget: int) -> BareResult:
        """`requests` are (prompt ids, output length), admitted in order, at most `batch` at once."""
        self.allocate(max(len(p) + n for p, n in requests))
        pending, rows, free = deque(requests), [], list(range(self.batch - 1, -1, -1))
        steps, full_steps = 0, []
        start = time.perf_counter()
        while pending or rows:
            joined = self._admit(pending, rows, free, prefill_budget)
            step_start = time.perf_counter()
            tokens = self.forward(rows)
            if not joined and len(rows) == self.batch:
                full_steps.append(time.perf_counter() - step_start)
            steps += 1
            rows = self._advance(rows, tokens, free)
        duration = time.perf_counter() - start
        median = statistics.median(full_steps) * 1000.0 if full_steps else None
        return BareResult(
            self.batch,
            len(requests),
            sum(len(p) for p, _ in requests),
            sum(n for _, n in requests),
            duration,
            steps,
            len(full_steps),
            median,
        )

    @staticmethod
    def _admit(pending: deque, rows: list[_Row], free: list[int], budget: int) -> bool:
        joined = 0
        while pending and free and (joined == 0 or joined + len(pending[0][0]) <= budget):
            prompt, output_len = pending.popleft()
            rows.append(_Row(free.pop(), 0, list(prompt), output_len))
            joined += len(prompt)
        return joined > 0

    @staticmethod
    def _advance(rows: list[_Row], tokens: list[int], free: list[int]) -> list[_Row]:
        kept = []
        for row, token in zip(rows, tokens):
            row.length, row.feed, row.remaining = row.length + len(row.feed), [token], row.remaining - 1
            if row.remaining > 0:
                kept.append(row)
            else:
                free.append(row.slot)
        return kept


def measure(
    model_dir: Path,
    texts: list[str],
    output_lens: list[int],
    batch: int,
    prefill_budget: int = 4096,
    warmup_steps: int = 2,
    dtype: str = "float32",
    gemm: str = "auto",
    quantize: str | None = None,
    device: str = "cpu",
) -> BareResult:
    """Loads the model (its linear layers on the `gemm` backend, see `layers/gemm.py`, weights quantized as
    `--quantize` would), warms it up on the first prompts, then runs the whole workload once, timed."""
    weights = f"{dtype}, --quantize {quantize}" if quantize else dtype
    note(f"bare forward: loading {model_dir} in-process, batch {batch}, {weights}, GEMM {gemm}")
    previous = os.environ.get("CONVEYOR_GEMM")
    os.environ["CONVEYOR_GEMM"] = gemm  # read when the layers pack their weights, i.e. while loading
    try:
        loop = BareLoop(model_dir, batch, dtype, quantize, device)
    finally:
        if previous is None:
            del os.environ["CONVEYOR_GEMM"]
        else:
            os.environ["CONVEYOR_GEMM"] = previous
    prompts = [loop.tokenize(t) for t in texts]
    loop.run([(p, warmup_steps) for p in prompts[:batch]], prefill_budget)
    note(f"bare forward: {len(prompts)} requests, {sum(output_lens)} output tokens...")
    return loop.run(list(zip(prompts, output_lens)), prefill_budget)
