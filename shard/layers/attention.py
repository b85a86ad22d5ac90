"""Attention over a paged KV cache, for a ragged batch of sequences in one flat forward.

Per layer the cache is a pool `[num_blocks, block_size, kv_heads, head_dim]`; a sequence's tokens live in the
blocks of its block table, token p at slot `table[p // block_size] * block_size + p % block_size`. A forward
writes its new tokens' K/V to their slots, gathers each sequence's context from its blocks into a padded
[B, C] view (one indexing operation, no loop over tokens), and runs `scaled_dot_product_attention` with a mask
that is causal within each sequence and hides the padding. Prefill rows (many new tokens) and decode rows (one)
go through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "KVCache":  # fmt: skip
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # empty, not zeros: pages are touched only when a block is first written.
        return cls(
            [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)],
            [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)],
        )

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0]

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass
class AttentionMetadata:
    """Index tensors for one forward, built once and shared by every layer."""

    slots: torch.Tensor  # [T] where each new token's K/V goes
    context_slots: torch.Tensor  # [B, C] the slots of each sequence's whole context, padded with slot 0
    mask: torch.Tensor  # [B, 1, Q, C] which context tokens each query sees
    query_index: torch.Tensor  # [B, Q] flat token index of each sequence's k-th new token (0 for padding)
    query_valid: torch.Tensor  # [B, Q] False for padding queries

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        """`context_lens` count each sequence's tokens after this forward; the last `query_lens` of them are new."""
        ctx = torch.tensor(context_lens, dtype=torch.long, device=device)
        qlen = torch.tensor(query_lens, dtype=torch.long, device=device)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)

        context = torch.arange(max(context_lens), device=device)
        context_slots = tables[:, context // block_size] * block_size + context % block_size

        k = torch.arange(max(query_lens), device=device)
        query_valid = k[None, :] < qlen[:, None]
        query_pos = (ctx - qlen)[:, None] + k[None, :]  # absolute position of each query
        starts = torch.cumsum(qlen, 0) - qlen
        query_index = torch.where(query_valid, starts[:, None] + k[None, :], torch.zeros_like(query_pos))

        seen = (context[None, None, :] <= query_pos[:, :, None]) & (context[None, None, :] < ctx[:, None, None])
        if sliding_window:
            seen &= context[None, None, :] > query_pos[:, :, None] - sliding_window
        seen &= query_valid[:, :, None]
        seen[:, :, 0] |= ~query_valid  # padding queries look at one token rather than none (no NaN)

        slots = context_slots.gather(1, query_pos.clamp(max=context_slots.shape[1] - 1))[query_valid]
        return cls(slots, context_slots, seen[:, None], query_index, query_valid)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; returns [T, Hq * D]."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    flat_keys = key_cache.view(-1, kv_heads, head_dim)
    flat_values = value_cache.view(-1, kv_heads, head_dim)
    flat_keys.index_copy_(0, meta.slots, k)
    flat_values.index_copy_(0, meta.slots, v)

    keys = flat_keys[meta.context_slots].transpose(1, 2)  # [B, Hkv, C, D]
    values = flat_values[meta.context_slots].transpose(1, 2)
    queries = q[meta.query_index].transpose(1, 2)  # [B, Hq, Q, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=q.shape[1] != kv_heads
    )
    return out.transpose(1, 2)[meta.query_valid].reshape(q.shape[0], -1)
