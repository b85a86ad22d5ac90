"""The engine in-process, without a server: the one public entry point for tools that measure the model itself (the
bare-forward ceiling, accuracy scores, the token mask's share of a step, a verify step's cost: benchmarks/bare.py,
accuracy.py, grammar.py, gpu_check.py, verify_rows.py).

The benchmarks reach the shard through this module alone (a contract in pyproject.toml), so what they rely on is
listed here, and the rooms behind it stay free to change. Everything runs on one rank, loaded as a shard loads it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from conveyor.shard.batch.running_batch import RunningBatch
from conveyor.shard.layers.attention import KVCache, build_per_window
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.sampling.masks import Masks, unpack
from conveyor.shard.sampling.sampler import greedy
from conveyor.shard.step.engine import Engine, StepOutput
from conveyor.shard.step.step_timing import verify_steps
from conveyor.v1 import shard_pb2 as pb

__all__ = [
    "RunningBatch",
    "Engine",
    "KVCache",
    "Masks",
    "StepOutput",
    "forward",
    "greedy",
    "join",
    "load",
    "unpack",
    "verify_steps",
]


def load(
    model_dir: Path,
    dtype: str = "float32",
    quantize: str | None = None,
    kv_cache_dtype: str = "auto",
    device: str = "cpu",
) -> Engine:
    """The model of `model_dir` on one rank (`device`: cpu, cuda or cuda:N), with the dtype, weight quantization
    and KV dtype a shard takes."""
    group = ProcessGroup(0, 1)
    return Engine(model_dir, dtype, torch.device(device), group, quantize, kv_cache_dtype=kv_cache_dtype)


@torch.inference_mode()
def forward(
    engine: Engine, cache: KVCache, rows: list[tuple[list[int], list[int], int]], logits_of: torch.Tensor
) -> torch.Tensor:
    """One flat forward, as a step runs it: each row is (tokens it feeds, its block table, tokens already cached).
    `logits_of`: the flat positions whose logits come back (a row's last token to sample it, or every position to
    score a text)."""
    device = engine.device
    ids = torch.tensor([t for feed, _, _ in rows for t in feed], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(length, length + len(feed)) for feed, _, length in rows]).to(device)
    query_lens = [len(feed) for feed, _, _ in rows]
    seq_lens = [length + len(feed) for feed, _, length in rows]
    tables = [table for _, table, _ in rows]
    metas = build_per_window(engine.model.windows, tables, seq_lens, query_lens, engine.block_size, device)
    return engine.model(ids, positions, cache, metas, logits_of.to(device))


def join(engine: Engine, running: RunningBatch | None, joining: pb.Batch) -> RunningBatch:
    """A Prefill's batch: the new requests' state joined after the running rows, as the gRPC service joins them."""
    joined = engine.batch(joining)
    return joined if running is None else RunningBatch.concatenate([running, joined])
