"""The paged engine: our Llama-family model over a KV pool whose blocks the router hands out.

A batch is plain bookkeeping (`paged_batch.py`), so filtering and joining batches copy no KV at all. Every step
is one flat forward over the new tokens of all its sequences: one token for each decoding row, a prompt chunk
for each prefilling row the router gave one (chunked prefill mixes them into the same forward).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

import torch

from conveyor.shard.device import to_device
from conveyor.shard.distributed import ProcessGroup
from conveyor.shard.engine import Engine, all_finished, timings
from conveyor.shard.layers.attention import AttentionMetadata, KVCache
from conveyor.shard.models.llama import LlamaForCausalLM
from conveyor.shard.paged_batch import PagedBatch
from conveyor.shard.requests import BadRequest
from conveyor.shard.weights import Weights
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
CPU_MEMORY_FRACTION = 0.3  # of the memory available after loading, for the KV pool on CPU
GPU_MEMORY_FRACTION = 0.9


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
        return super().info(requires_padding=False, block_size=self.block_size, support_chunking=True,
                            use_prefix_caching=True)  # fmt: skip

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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the scratch pool's memory goes back before the free memory is read
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

    def prefill(
        self, batch_pb: pb.Batch, cached: PagedBatch | None = None, updates: list[pb.RequestUpdate] = ()
    ) -> tuple[list[pb.Generation], PagedBatch | None, pb.Timings]:
        """New requests join (`cached`, the running batch, if any) and the step runs over all of them."""
        if self.cache is None:
            raise BadRequest("the KV pool is not allocated yet: call Warmup first")
        new = PagedBatch.prefilling(batch_pb.id, self.states(batch_pb), batch_pb, self.block_size)
        if cached is None:
            return self.step(new)
        cached.update(updates)
        return self.step(PagedBatch.concatenate([cached, new]))

    def decode(
        self, batches: list[PagedBatch], updates: list[pb.RequestUpdate] = ()
    ) -> tuple[list[pb.Generation], PagedBatch | None, pb.Timings]:
        batch = PagedBatch.concatenate(batches)
        batch.update(updates)
        return self.step(batch)

    @torch.inference_mode()
    def step(self, batch: PagedBatch) -> tuple[list[pb.Generation], PagedBatch | None, pb.Timings]:
        """One forward: each decoding row feeds its next token, each prefilling row its chunk. Decoding rows and
        rows whose chunk ends their prompt sample a token; the batch is gone once every request has finished."""
        start = time.perf_counter_ns()
        rows = list(range(batch.decoding)) + [r for r, c in zip(range(batch.decoding, batch.size), batch.chunks) if c]
        if not rows:
            raise BadRequest(f"batch {batch.id} has nothing to compute at this step")
        new_tokens, ending = [], []
        for row in rows:
            state, length = batch.requests[row], batch.lengths[row]
            if row < batch.decoding:
                new_tokens.append([batch.next_ids[row]])
            else:
                chunk = batch.chunks[row - batch.decoding]
                new_tokens.append(state.input_ids[length : length + chunk])
                if length + chunk == len(state.input_ids):
                    ending.append(row)
            self._check_blocks(state.id, batch.blocks[row], length + len(new_tokens[-1]))
        starts = [batch.lengths[r] for r in rows]
        lengths = [s + len(n) for s, n in zip(starts, new_tokens)]
        logits = self._forward(new_tokens, starts, [batch.blocks[r] for r in rows], lengths,
                               self._logit_counts(batch, rows, new_tokens, ending))  # fmt: skip
        forward_done = time.perf_counter_ns()
        for row, length in zip(rows, lengths):
            batch.lengths[row] = length
        generations = self._sample(batch, ending, logits)
        finished = all_finished(generations) and len(generations) == batch.size  # no row left prefilling
        return generations, None if finished else batch, timings(start, forward_done)

    def _logit_counts(
        self, batch: PagedBatch, rows: list[int], new_tokens: list[list[int]], ending: list[int]
    ) -> list[int]:
        """How many logits each row of the forward keeps: its last for a row that samples, every position for a
        prompt whose log-probabilities were asked for, none for a chunk that leaves its prompt unfinished."""
        counts = []
        for row, tokens in zip(rows, new_tokens):
            if row < batch.decoding:
                counts.append(1)
            elif row not in ending:
                counts.append(0)
            else:
                counts.append(len(tokens) if batch.requests[row].prefill_logprobs else 1)
        return counts

    def _sample(self, batch: PagedBatch, ending: list[int], logits: torch.Tensor) -> list[pb.Generation]:
        """Samples the decoding rows with the batch's sampler and the rows that just finished their prompt with
        a new one, which then joins the batch's."""
        generations: list[pb.Generation] = []
        decoding = batch.decoding
        if decoding:
            generations, batch.next_ids = self.generations(batch.requests[:decoding], batch.sampler, logits[:decoding])
        if not ending:
            return generations
        states = [batch.requests[r] for r in ending]
        counts = [len(s.input_ids) if s.prefill_logprobs else 1 for s in states]
        ends = (decoding + torch.cumsum(torch.tensor(counts), 0)).tolist()
        sampler = self.sampler(states)
        new, ids = self.generations(states, sampler, logits[[e - 1 for e in ends]])
        for state, generation, end, count in zip(states, new, ends, counts):
            if state.prefill_logprobs:
                generation.prefill_tokens.CopyFrom(self.prefill_tokens(state, logits[end - count : end]))
        batch.start_decoding(ending, ids, sampler)
        return generations + new

    def _check_blocks(self, request_id: int, table: list[int], tokens: int) -> None:
        if len(table) * self.block_size < tokens:
            raise BadRequest(f"request {request_id} needs {tokens} KV slots but has {len(table)} blocks")
        if table and max(table) >= self.cache.num_blocks:
            raise BadRequest(f"request {request_id} names blocks beyond the pool of {self.cache.num_blocks}")

    def _forward(
        self, new_tokens: list[list[int]], starts: list[int], blocks: list[list[int]], lengths: list[int],
        logit_counts: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """One flat forward: sequence i feeds `new_tokens[i]` at positions starts[i]..lengths[i]-1. Returns the
        logits of the last `logit_counts[i]` positions of each sequence, in order."""
        device = self.device
        ids = to_device(torch.tensor([t for n in new_tokens for t in n], dtype=torch.long), device)
        positions = to_device(torch.cat([torch.arange(s, s + len(n)) for s, n in zip(starts, new_tokens)]), device)
        query_lens = [len(n) for n in new_tokens]
        meta = AttentionMetadata.build(blocks, lengths, query_lens, self.block_size, device,
                                       self.model.sliding_window)  # fmt: skip
        ends = torch.cumsum(torch.tensor(query_lens), 0).tolist()
        keep = torch.cat([torch.arange(e - c, e) for e, c in zip(ends, logit_counts)])
        return self.model(ids, positions, self.cache, meta, to_device(keep, device))


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
