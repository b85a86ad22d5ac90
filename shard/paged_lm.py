"""The paged engine: our Llama-family model over a KV pool whose blocks the router hands out.

A batch is plain bookkeeping (each request's block table, cached length and next token), so filtering and
joining batches copy no KV at all: only lists change. Every step is one flat forward over the new tokens of all
its sequences.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.shard.distributed import ProcessGroup
from conveyor.shard.engine import Engine, all_finished, timings
from conveyor.shard.layers.attention import AttentionMetadata, KVCache
from conveyor.shard.models.llama import LlamaForCausalLM
from conveyor.shard.requests import BadRequest, RequestState, rows_of
from conveyor.shard.sampling import Sampler
from conveyor.shard.weights import Weights
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
CPU_MEMORY_FRACTION = 0.3  # of the memory available after loading, for the KV pool on CPU
GPU_MEMORY_FRACTION = 0.9


@dataclass
class PagedBatch:
    id: int
    requests: list[RequestState]
    blocks: list[list[int]]  # each request's block table, as the router allocated it
    lengths: list[int]  # tokens whose KV is in the cache, per request
    next_ids: list[int]  # the token each request feeds next
    sampler: Sampler
    block_size: int

    @property
    def size(self) -> int:
        return len(self.requests)

    def to_pb(self) -> pb.CachedBatch:
        return pb.CachedBatch(
            id=self.id,
            request_ids=[r.id for r in self.requests],
            size=self.size,
            max_tokens=sum(len(b) for b in self.blocks) * self.block_size,
            current_tokens=self.size,
        )

    def filter(self, request_ids: list[int]) -> "PagedBatch":
        rows = rows_of(self.requests, request_ids, self.id)
        return PagedBatch(
            self.id,
            [self.requests[r] for r in rows],
            [self.blocks[r] for r in rows],
            [self.lengths[r] for r in rows],
            [self.next_ids[r] for r in rows],
            self.sampler.filter(rows),
            self.block_size,
        )

    @classmethod
    def concatenate(cls, batches: list["PagedBatch"]) -> "PagedBatch":
        if len(batches) == 1:
            return batches[0]
        return cls(
            batches[0].id,
            [r for b in batches for r in b.requests],
            [t for b in batches for t in b.blocks],
            [n for b in batches for n in b.lengths],
            [t for b in batches for t in b.next_ids],
            Sampler.concatenate([b.sampler for b in batches]),
            batches[0].block_size,
        )


class PagedCausalLM(Engine):
    engine = "paged"

    def __init__(self, model_dir: str | Path, dtype: str, device: torch.device, group: ProcessGroup) -> None:
        super().__init__(model_dir, dtype, device, group.world_size)
        self.group = group
        self.block_size = BLOCK_SIZE
        self.model = LlamaForCausalLM(self.config, Weights(model_dir, group, self.dtype, device)).eval()
        shape = self.model.shape
        self._cache_shape = (self.config.num_hidden_layers, shape.kv_heads_per_rank, shape.head_dim)
        self.cache: KVCache | None = None

    def info(self) -> pb.InfoResponse:
        return super().info(requires_padding=False, block_size=self.block_size)

    # --- KV pool ------------------------------------------------------------------------------------------

    def _allocate(self, num_blocks: int) -> KVCache:
        layers, kv_heads, head_dim = self._cache_shape
        return KVCache.allocate(layers, num_blocks, self.block_size, kv_heads, head_dim, self.dtype, self.device)

    def warmup(self, request: pb.WarmupRequest) -> int:
        """Runs the largest prefill on a scratch pool, then sizes the real pool from the memory left (or from
        the token budget the router was given) and returns its capacity in tokens, agreed by all ranks."""
        next_block = 0
        for r in request.batch.requests:
            count = math.ceil((len(r.input_ids) + r.stopping_parameters.max_new_tokens) / self.block_size)
            del r.blocks[:]
            r.blocks.extend(range(next_block, next_block + count))
            next_block += count
        self.cache = self._allocate(next_block)
        _, batch, _ = self.prefill(request.batch)
        if batch is not None:
            self.decode([batch])
        self.cache = None
        num_blocks = self.group.min(self._pool_blocks(request.max_batch_total_tokens))
        self.cache = self._allocate(num_blocks)
        log.info("kv pool", extra={"blocks": num_blocks, "tokens": num_blocks * self.block_size})
        return num_blocks * self.block_size

    def _pool_blocks(self, requested_tokens: int) -> int:
        if requested_tokens:
            return math.ceil(requested_tokens / self.block_size)
        layers, kv_heads, head_dim = self._cache_shape
        per_block = KVCache.bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.dtype)
        return max(1, int(_free_memory(self.device) // per_block))

    # --- steps --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, batch_pb: pb.Batch) -> tuple[list[pb.Generation], PagedBatch | None, pb.Timings]:
        """Writes each prompt's KV into its blocks and samples its first token, in one flat forward."""
        start = time.perf_counter_ns()
        if self.cache is None:
            raise BadRequest("the KV pool is not allocated yet: call Warmup first")
        states = self.states(batch_pb)
        blocks = [list(r.blocks) for r in batch_pb.requests]
        cached = [r.cache_len for r in batch_pb.requests]
        for state, table in zip(states, blocks):
            self._check_blocks(state.id, table, len(state.input_ids) + state.stopping.max_new_tokens - 1)
        new = [s.input_ids[c:] for s, c in zip(states, cached)]
        lengths = [len(s.input_ids) for s in states]
        wants_all = [s.prefill_logprobs for s in states]
        logits = self._forward(new, cached, blocks, lengths, wants_all)
        forward_done = time.perf_counter_ns()
        # The logits hold every new position of the sequences that asked for prompt logprobs, the last otherwise.
        counts = [len(n) if a else 1 for n, a in zip(new, wants_all)]
        ends = torch.cumsum(torch.tensor(counts), 0)
        sampler = self.sampler(states)
        generations, ids = self.generations(states, sampler, logits[ends - 1])
        for state, generation, end, count in zip(states, generations, ends.tolist(), counts):
            if state.prefill_logprobs:
                generation.prefill_tokens.CopyFrom(self.prefill_tokens(state, logits[end - count : end]))
        batch = PagedBatch(batch_pb.id, states, blocks, lengths, ids, sampler, self.block_size)
        return generations, None if all_finished(generations) else batch, timings(start, forward_done)

    @torch.inference_mode()
    def decode(self, batches: list[PagedBatch]) -> tuple[list[pb.Generation], PagedBatch | None, pb.Timings]:
        start = time.perf_counter_ns()
        batch = PagedBatch.concatenate(batches)
        lengths = [n + 1 for n in batch.lengths]
        logits = self._forward([[t] for t in batch.next_ids], batch.lengths, batch.blocks, lengths, None)
        forward_done = time.perf_counter_ns()
        generations, batch.next_ids = self.generations(batch.requests, batch.sampler, logits)
        batch.lengths = lengths
        return generations, None if all_finished(generations) else batch, timings(start, forward_done)

    def _check_blocks(self, request_id: int, table: list[int], tokens: int) -> None:
        if len(table) * self.block_size < tokens:
            raise BadRequest(f"request {request_id} needs {tokens} KV slots but has {len(table)} blocks")
        if table and max(table) >= self.cache.num_blocks:
            raise BadRequest(f"request {request_id} names blocks beyond the pool of {self.cache.num_blocks}")

    def _forward(
        self, new_tokens: list[list[int]], starts: list[int], blocks: list[list[int]], lengths: list[int],
        all_logits: list[bool] | None,
    ) -> torch.Tensor:  # fmt: skip
        """One flat forward: sequence i feeds `new_tokens[i]` at positions starts[i]..lengths[i]-1.
        Returns logits for each sequence's last token, or for all its tokens where `all_logits[i]`."""
        device = self.device
        ids = torch.tensor([t for n in new_tokens for t in n], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(s, s + len(n)) for s, n in zip(starts, new_tokens)]).to(device)
        query_lens = [len(n) for n in new_tokens]
        meta = AttentionMetadata.build(blocks, lengths, query_lens, self.block_size, device,
                                       self.model.sliding_window)  # fmt: skip
        ends = torch.cumsum(torch.tensor(query_lens), 0)
        if all_logits and any(all_logits):
            keep = torch.cat([torch.arange(e - q, e) if a else torch.tensor([e - 1])
                              for e, q, a in zip(ends.tolist(), query_lens, all_logits)])  # fmt: skip
        else:
            keep = ends - 1
        return self.model(ids, positions, self.cache, meta, keep.to(device))


def _free_memory(device: torch.device) -> float:
    """Bytes the KV pool may take: a share of what is free now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * GPU_MEMORY_FRACTION
    return _available_ram() * CPU_MEMORY_FRACTION / max(1, int(os.environ.get("WORLD_SIZE", "1")))


def _available_ram() -> float:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30
