"""The prefix cache's second tier (`--kv-offload-dir`): full prompt blocks' KV on disk, so that a restarted shard, or
a new replica on the same volume, reads a known prefix instead of prefilling it.

The router's prefix cache lives in memory and dies with the processes. Here every full block of a prompt that a
prefill computes is written through to a file (on a writer thread, from a copy taken before the step returns, so
that a SIGKILL loses at most the blocks still queued), named by a chain of hashes: a block's key covers the
model's fingerprint, the request's cache scope (the router's `CacheScope`, as a digest: whose blocks may be
shared) and every token up to the block's end, so one key can never name another scope's or another model's KV.
When a prefill chunk starts on a block boundary, its blocks found on disk are read into the request's own blocks
and only the rest of the chunk is computed (at least its last token: the prompt's last logits are always
computed, as with the memory cache). The files themselves (their checks, the writer thread, the cap) are
block_files.py's.

Requests through a LoRA adapter, asking for prompt log-probabilities, or without a scope stay in memory only.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from conveyor.shard.kv_offload.block_files import DiskTier, digest


def fingerprint(model_dir: Path, facts: dict[str, object]) -> bytes:
    """What a block's KV depends on besides its tokens: the model's config, its weight files (names, sizes and
    samples of their bytes: a fine-tune has the same config and sizes), and `facts` (dtype, KV dtype, block size,
    rank and world size, quantization, format)."""
    parts = [json.dumps(facts, sort_keys=True).encode(), (model_dir / "config.json").read_bytes()]
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        parts.append(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            for i in range(16):  # 16 samples of 4 KiB spread over the file
                f.seek(size * i // 16)
                parts.append(f.read(4096))
    return digest(*parts)


def chain(root: bytes, tokens: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """The keys of the first `count` full blocks of `tokens`: each the digest of the one before and its tokens."""
    keys, key = [], root
    for b in range(count):
        block = tokens[b * block_size : (b + 1) * block_size]
        key = digest(key, struct.pack(f"<{len(block)}I", *block))
        keys.append(key)
    return keys


def block_payload(keys: list[torch.Tensor], values: list[torch.Tensor], block: int) -> bytes:
    """A block's KV from every layer's pool, K then V a layer, as bytes."""
    parts = []
    for k, v in zip(keys, values):
        for pool in (k, v):
            parts.append(pool[block].contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def restore_block(keys: list[torch.Tensor], values: list[torch.Tensor], block: int, payload: bytes) -> None:
    """Writes a payload of `block_payload`'s layout into `block` of every layer's pool."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    offset = 0
    for k, v in zip(keys, values):
        for pool in (k, v):
            dest = pool[block]
            size = dest.numel() * dest.element_size()
            dest.view(torch.uint8).view(-1).copy_(data[offset : offset + size].to(dest.device))
            offset += size


class PrefixOffload:
    """The engine's side of the tier: which blocks a step may read from disk, and which it writes."""

    def __init__(self, tier: DiskTier, block_size: int, group) -> None:
        self.tier, self.block_size, self.group = tier, block_size, group
        self.loaded_tokens = 0  # this step's, for its timings
        self.load_ns = 0

    @staticmethod
    def takes(state) -> bool:
        """Whether a request's blocks may go to disk and come back: a scope to key them by, the base model's KV,
        no prompt log-probabilities or pooling over every position (those need every prompt token computed), and no
        images (the disk keys are the tokens', and every image has the same placeholder tokens)."""
        return (
            bool(state.cache_scope) and not state.adapter and not state.computes_every_prompt_token and not state.images
        )

    def keys(self, state, count: int) -> list[bytes]:
        """The chain keys of the request's first `count` full blocks (kept on the request, extended as needed)."""
        if len(state.offload_keys) < count:
            root = state.offload_keys[-1] if state.offload_keys else digest(self.tier.fp, state.cache_scope.encode())
            done = len(state.offload_keys)
            more = chain(root, state.input_ids[done * self.block_size :], self.block_size, count - done)
            state.offload_keys.extend(more)
        return state.offload_keys[:count]

    def load(self, prefilling: list, cache) -> None:
        """Before the forward: each chunk that starts on a block boundary takes the blocks of it found on disk (all
        but its last token's), in order, and reads only the rest. Ranks agree on how many each request took."""
        self.loaded_tokens, start_ns = 0, time.perf_counter_ns()
        for state in prefilling:
            if not self.takes(state) or state.num_computed_tokens % self.block_size:
                continue
            first = state.num_computed_tokens // self.block_size
            last = (state.num_computed_tokens + state.chunk_len - 1) // self.block_size  # blocks before the last token
            last = min(last, len(state.block_table))  # the router's table covers the chunk; never read past it
            if last <= first:
                continue
            keys = self.keys(state, last)
            count = 0
            for b in range(first, last):
                payload = self.tier.read(keys[b]) if self.tier.has(keys[b]) else None
                if payload is None:
                    break
                restore_block(cache.keys, cache.values, state.block_table[b], payload)
                count += 1
            count = self.group.min(count)
            if count:
                tokens = count * self.block_size
                state.num_computed_tokens += tokens
                state.chunk_len -= tokens
                state.disk_cached_tokens += tokens
                self.loaded_tokens += tokens
        self.load_ns = time.perf_counter_ns() - start_ns

    def save(self, prefilling: list, before: list[int], cache) -> None:
        """After the forward: the prompt blocks each chunk completed, copied now and written by the writer thread."""
        for state, start in zip(prefilling, before):
            if not self.takes(state):
                continue
            first, end = start // self.block_size, min(state.num_computed_tokens, len(state.input_ids))
            count = end // self.block_size
            if count <= first:
                continue
            keys = self.keys(state, count)
            for b in range(first, count):
                if not self.tier.has(keys[b]):
                    self.tier.save(keys[b], block_payload(cache.keys, cache.values, state.block_table[b]))
