"""Attention over a paged KV cache, for a ragged batch of sequences in one flat forward.

Per layer the cache is a pool `[num_blocks, block_size, kv_heads, head_dim]`; a sequence's tokens live in the
blocks of its block table, token p at slot `table[p // block_size] * block_size + p % block_size`. A forward
writes its new tokens' K/V to their slots, gathers each sequence's context from its blocks into a padded
[B, C] view (one indexing operation, no loop over tokens), and runs `scaled_dot_product_attention` with a mask
that is causal within each sequence and hides the padding. Prefill rows (many new tokens) and decode rows (one)
go through the same code.

Decode rows have a faster path on CPU: `shard/kernels/paged_attention.cpp` reads their K/V in place through the
block tables, with no gathered copy and no mask (`DecodeGroup`). So do prompt chunks of `LONE_CHUNK_TOKENS` or more
in float32: each is a group of its own, and `shard/kernels/prefill_attention.cpp` attends it causally at its offset
in the context, tile by tile on oneDNN's brgemm, without a mask. The gather + SDPA path stays the reference, and
serves everything where the kernels are off or did not build.

A chunk that holds an image's tokens (Gemma 3) also lets those tokens see each other both ways (`Blocks`): it takes
the masked path, in a group of its own kind, so text-only rows keep the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import kv_quant
from conveyor.shard.runtime.device import to_device


@dataclass
class KVCache:
    keys: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(
        cls,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (num_blocks, block_size, kv_heads, kv_quant.row_width(head_dim, dtype))
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
        """`dtype`: the pool's (the model's, or int8 for 8-bit rows with their scales)."""
        return 2 * layers * block_size * kv_heads * kv_quant.row_width(head_dim, dtype) * dtype.itemsize


@dataclass
class AttentionGroup:
    """Sequences attended together, padded to the group's longest query and context.

    Padding is what a batched SDPA costs: a decode row padded to a 256-token prompt chunk would do 256 times
    its work, against a 2k-token context. So decode rows (one query each) form one group, and prompt chunks
    are grouped by context length, a new group whenever the context halves."""

    context_slots: torch.Tensor  # [B, C] the slots of each sequence's whole context, padded with its first
    mask: torch.Tensor  # [B, 1, Q, C] which context tokens each query sees
    query_index: torch.Tensor  # [B, Q] flat token index of each sequence's k-th new token (0 for padding)
    query_valid: torch.Tensor  # [B, Q] False for padding queries
    token_index: torch.Tensor  # [T_g] flat index of each of the group's tokens, in query_valid's order
    # The mask is plain causal: whole prompts of one length, no window. SDPA then skips the score blocks above the
    # diagonal, which a mask makes it compute: at 2,300 tokens (SmolLM2's heads) 42 ms a layer instead of 80, with
    # the same bits (a masked block adds nothing to a row's sums).
    causal: bool = False
    # One sequence's prompt chunk, for the prefill kernel (CPU, float32, no window, no soft cap).
    kernel: bool = False

    def to(self, device: torch.device) -> AttentionGroup:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return AttentionGroup(**{k: to_device(v, device) if torch.is_tensor(v) else v for k, v in moved.items()})


@dataclass
class DecodeGroup:
    """Decode rows for the paged kernel, which reads their contexts through the block tables themselves."""

    block_tables: torch.Tensor  # [B, W] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32, the new token included
    token_index: torch.Tensor  # [B] flat index of each row's one new token
    window: int  # sliding window, 0 for none

    @classmethod
    def build(
        cls, block_tables: list[list[int]], context_lens: list[int], starts: list[int], window: int | None
    ) -> DecodeGroup:
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        return cls(tables, lens, torch.tensor(starts, dtype=torch.long), window or 0)


# Prompt chunks this long attend alone (a group each) through the prefill kernel where it serves: a group of its
# own costs a call per layer, which shorter chunks, grouped, share.
LONE_CHUNK_TOKENS = 32


def decode_kernel(device: torch.device) -> bool:
    """Whether decode rows on `device` take the paged kernel (CPU, where it built and is not switched off)."""
    return kernels.serves(device)


@dataclass
class AttentionMetadata:
    """Index tensors for one forward, built once and shared by every layer."""

    slots: torch.Tensor  # [T] where each new token's K/V goes
    groups: list[AttentionGroup | DecodeGroup]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        use_kernel: bool | None = None,
        blocks: Blocks | None = None,
    ) -> AttentionMetadata:
        """`context_lens` count each sequence's tokens after this forward; the last `query_lens` of them are new.
        Decode rows take the paged kernel if `use_kernel` (by default: `decode_kernel(device)`). `blocks`: each
        sequence's spans of new tokens that see each other both ways (none: causal only)."""
        starts = [0]
        for q in query_lens[:-1]:
            starts.append(starts[-1] + q)
        slots = []
        for table, ctx, q in zip(block_tables, context_lens, query_lens):
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx))
        # Built on the host, then moved (from pinned memory on a GPU) in one go per tensor.
        host = torch.device("cpu")
        kernel = decode_kernel(device) if use_kernel is None else use_kernel
        lone = LONE_CHUNK_TOKENS if kernel and not sliding_window else None
        spans = blocks or [[] for _ in query_lens]
        partition = _partition(context_lens, query_lens, lone, [bool(b) for b in spans])
        groups: list[AttentionGroup | DecodeGroup] = []
        if partition and all(query_lens[r] == 1 for r in partition[0]):
            if kernel:
                rows = partition.pop(0)
                tables, lens = [block_tables[r] for r in rows], [context_lens[r] for r in rows]
                groups.append(DecodeGroup.build(tables, lens, [starts[r] for r in rows], sliding_window))
        groups += [
            _group(
                [block_tables[r] for r in rows],
                [context_lens[r] for r in rows],
                [query_lens[r] for r in rows],
                [starts[r] for r in rows],
                block_size,
                host,
                sliding_window,
                len(rows) == 1 and _alone(query_lens[rows[0]], lone) and not spans[rows[0]],
                [spans[r] for r in rows],
            )
            for rows in partition
        ]
        return cls(to_device(torch.tensor(slots, dtype=torch.long), device), [_on(g, device) for g in groups])


Metadatas = dict[int | None, AttentionMetadata]  # by sliding window (None: global attention)
# Per sequence, the spans [first, end) of positions among its new tokens that attend to each other both ways (an
# image's soft tokens, as Gemma 3 defines its mask): causal attention or'ed with "same span", then the window.
Blocks = list[list[tuple[int, int]]]


def build_per_window(
    windows: tuple[int | None, ...],
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    device: torch.device,
    blocks: Blocks | None = None,
) -> Metadatas:
    """One metadata per sliding window the model's layers use (Gemma 3 interleaves windowed and global layers;
    most models have one kind): each layer reads the one for its window. `blocks`: as `AttentionMetadata.build`."""
    return {
        w: AttentionMetadata.build(block_tables, context_lens, query_lens, block_size, device, w, blocks=blocks)
        for w in windows
    }


def _on(group: AttentionGroup | DecodeGroup, device: torch.device) -> AttentionGroup | DecodeGroup:
    return group.to(device) if isinstance(group, AttentionGroup) else group  # the kernel runs on the CPU only


def _partition(
    context_lens: list[int], query_lens: list[int], lone: int | None = None, masked: list[bool] | None = None
) -> list[list[int]]:
    """Decode rows together; prompt chunks of `lone` tokens or more (if given) a group each, but those `masked`
    (with image blocks), which the kernel cannot attend; the other chunks by context length, longest first, a new
    group when it halves."""
    masked = masked or [False] * len(query_lens)
    decode = [r for r, q in enumerate(query_lens) if q == 1 and not masked[r]]
    alone = [[r] for r, q in enumerate(query_lens) if _alone(q, lone) and not masked[r]]
    chunks = sorted(
        (r for r, q in enumerate(query_lens) if r not in decode and [r] not in alone), key=lambda r: -context_lens[r]
    )
    groups = [decode] if decode else []
    groups += alone
    first = len(groups)  # grouped chunks start here
    for r in chunks:
        if len(groups) > first and context_lens[r] * 2 > context_lens[groups[-1][0]]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return [sorted(g) for g in groups]  # rows in flat order: one group's outputs are then the tokens' order


def _alone(query_len: int, lone: int | None) -> bool:
    """Whether a prompt chunk of `query_len` tokens is a group of its own (`lone`: the least such, None: none is)."""
    return lone is not None and query_len >= lone


def _group(
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    starts: list[int],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
    kernel: bool = False,
    blocks: Blocks | None = None,
) -> AttentionGroup:
    ctx = torch.tensor(context_lens, dtype=torch.long, device=device)
    qlen = torch.tensor(query_lens, dtype=torch.long, device=device)
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)

    context = torch.arange(max(context_lens), device=device)
    context_slots = tables[:, context // block_size] * block_size + context % block_size
    # Padding reads the row's first token, which holds real numbers: a slot nobody wrote may hold NaN bits, and
    # a masked-out NaN still poisons the output (0 x NaN).
    context_slots = torch.where(context[None, :] < ctx[:, None], context_slots, context_slots[:, :1])

    k = torch.arange(max(query_lens), device=device)
    query_valid = k[None, :] < qlen[:, None]
    query_pos = (ctx - qlen)[:, None] + k[None, :]  # absolute position of each query
    first = torch.tensor(starts, dtype=torch.long, device=device)
    query_index = torch.where(query_valid, first[:, None] + k[None, :], torch.zeros_like(query_pos))

    seen = (context[None, None, :] <= query_pos[:, :, None]) & (context[None, None, :] < ctx[:, None, None])
    for row, spans in enumerate(blocks or ()):
        for first, end in spans:  # positions; the span's tokens are all among this forward's (the chunk's)
            inside = (query_pos[row] >= first) & (query_pos[row] < end)
            seen[row] |= inside[:, None] & (context >= first)[None, :] & (context < end)[None, :]
    if sliding_window:
        seen &= context[None, None, :] > query_pos[:, :, None] - sliding_window
    seen &= query_valid[:, :, None]
    seen[:, :, 0] |= ~query_valid  # padding queries look at one token rather than none (no NaN)
    causal = not sliding_window and len(set(query_lens)) == 1 and query_lens == context_lens and not any(blocks or ())
    token_index = query_index[query_valid]
    return AttentionGroup(context_slots, seen[:, None], query_index, query_valid, token_index, causal, kernel)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens; returns [T, Hq * D]. `softcap` (Gemma 2): scores become
    cap * tanh(score / cap) before the softmax; 0 for none."""
    kv_quant.write(key_cache, meta.slots, k)
    kv_quant.write(value_cache, meta.slots, v)
    return attend(q, key_cache, value_cache, meta, scale, softcap)


def attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`paged_attention` once the new tokens' K/V are in the caches (written by `paged_attention` itself, or by
    the fused `rotary_kv_` kernel); returns [T, Hq * D]."""
    flat_keys, flat_values = key_cache.view(-1, *key_cache.shape[2:]), value_cache.view(-1, *value_cache.shape[2:])
    if len(meta.groups) == 1:
        group = meta.groups[0]
        return _attend(q, flat_keys, flat_values, group, scale, softcap, key_cache, value_cache).reshape(q.shape[0], -1)
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.token_index] = _attend(q, flat_keys, flat_values, group, scale, softcap, key_cache, value_cache)
    return out.reshape(q.shape[0], -1)


def _attend(
    q: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    group: AttentionGroup | DecodeGroup,
    scale: float,
    softcap: float,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> torch.Tensor:
    """The group's tokens' attention outputs [T_g, Hq, D], in `token_index` order."""
    if isinstance(group, DecodeGroup):
        return torch.ops.conveyor.paged_decode_attention(
            q[group.token_index],
            key_cache,
            value_cache,
            group.block_tables,
            group.context_lens,
            scale,
            group.window,
            softcap,
        )
    if group.kernel and not softcap and q.dtype == torch.float32:
        slots = group.context_slots[0]  # one sequence, unpadded: its context in order, the chunk's tokens last
        if not kv_quant.quantized(flat_keys):  # the kernel reads the pool's rows in place
            return torch.ops.conveyor.prefill_attention_paged(
                q[group.token_index], flat_keys, flat_values, slots, scale
            )
        keys, values = kv_quant.gather(flat_keys, slots, q.dtype), kv_quant.gather(flat_values, slots, q.dtype)
        return torch.ops.conveyor.prefill_attention(q[group.token_index], keys, values, scale)
    # index_select on the flattened slots: the same rows as advanced indexing, faster on CPU (this path's decode
    # step: the bare forward, benchmarks/bare.py, with CONVEYOR_ATTENTION=torch).
    shape = (*group.context_slots.shape, flat_keys.shape[1], q.shape[-1])
    slots = group.context_slots.view(-1)
    keys = kv_quant.gather(flat_keys, slots, q.dtype).view(shape).transpose(1, 2)  # [B, Hkv, C, D]
    values = kv_quant.gather(flat_values, slots, q.dtype).view(shape).transpose(1, 2)
    queries = q[group.query_index].transpose(1, 2)  # [B, Hq, Q, D]
    if softcap:
        out = _capped_attention(queries, keys, values, group.mask, scale, softcap)
    else:
        mask = None if group.causal else group.mask
        out = F.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=group.causal,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
    return out.transpose(1, 2)[group.query_valid]


def _capped_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: written out, in the order transformers' Gemma 2
    computes it (scale, cap, mask, a float32 softmax rounded back to the dtype, then the values)."""
    repeat = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)
