"""Paged attention over a ragged batch (decode rows and prompt chunks in one forward) against plain attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers.attention import AttentionGroup, AttentionMetadata, DecodeGroup, KVCache, paged_attention

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start.. over one sequence's whole context [C, Hkv, D]."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
    positions = torch.arange(start, start + q.shape[0])
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@pytest.fixture(scope="module")
def kernel_built() -> bool:
    return kernels.load()


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "kernel"])
def test_decode_rows_and_chunks_of_several_lengths_match_plain_attention(use_kernel: bool, kernel_built: bool) -> None:
    if use_kernel and not kernel_built:
        pytest.skip("the C++ kernels did not build here (test_paged_kernel covers the fallback)")
    torch.manual_seed(0)
    # (context after this forward, new tokens): decode rows, a long chunk, a whole short prompt, a mid chunk, and
    # chunks long enough to attend alone (the prefill kernel's groups): one at an offset, one a whole prompt.
    rows = [(40, 1), (100, 8), (5, 5), (9, 1), (30, 12), (2, 2), (150, 40), (33, 33)]
    cache = KVCache.allocate(1, 128, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    cache.keys[0].fill_(float("nan"))  # what a slot nobody wrote may hold: it must never reach an output
    cache.values[0].fill_(float("nan"))
    tables, next_block = [], 1  # block 0 stays unused, so a stray padding slot would show
    keys = [torch.randn(c, KV_HEADS, DIM) for c, _ in rows]
    values = [torch.randn(c, KV_HEADS, DIM) for c, _ in rows]
    for (context, new), k, v in zip(rows, keys, values):
        table = list(range(next_block, next_block + -(-context // BLOCK) + 1))[::-1]  # out of order, one spare
        next_block += len(table)
        tables.append(table)
        old = context - new
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(old)]
        cache.keys[0].view(-1, KV_HEADS, DIM)[slots] = k[:old]
        cache.values[0].view(-1, KV_HEADS, DIM)[slots] = v[:old]
    queries = [torch.randn(new, HEADS, DIM) for _, new in rows]
    lens = [c for c, _ in rows], [n for _, n in rows]
    meta = AttentionMetadata.build(tables, *lens, BLOCK, torch.device("cpu"), use_kernel=use_kernel)
    assert len(meta.groups) > 1  # decode rows apart from chunks, long contexts apart from short ones
    assert isinstance(meta.groups[0], DecodeGroup) == use_kernel
    lone = [g for g in meta.groups if isinstance(g, AttentionGroup) and g.kernel]
    assert [len(g.token_index) for g in lone] == ([40, 33] if use_kernel else [])

    out = paged_attention(
        torch.cat(queries),
        torch.cat([k[c - n :] for (c, n), k in zip(rows, keys)]),
        torch.cat([v[c - n :] for (c, n), v in zip(rows, values)]),
        cache.keys[0],
        cache.values[0],
        meta,
        DIM**-0.5,
    )
    expected = torch.cat(
        [reference(q, k, v, c - n).reshape(n, -1) for (c, n), q, k, v in zip(rows, queries, keys, values)]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "window", "causal"),
    [
        ([(300, 300)], None, True),  # a whole prompt
        ([(70, 70), (70, 70)], None, True),  # whole prompts of one length: no padding either
        ([(70, 70), (60, 60)], None, False),  # padded: the mask hides the padding
        ([(300, 100)], None, False),  # a chunk after cached tokens: the diagonal is not the square's
        ([(300, 300)], 16, False),  # a sliding window
    ],
    ids=["whole-prompt", "two-whole-prompts", "unequal", "chunk-at-offset", "window"],
)
def test_whole_prompts_attend_causally_without_a_mask_with_the_same_bits(rows: list, window, causal: bool) -> None:
    """SDPA told `is_causal` skips the blocks above the diagonal instead of computing and masking them: taken only
    where the mask is exactly causal, and giving the masked path's bits there."""
    torch.manual_seed(1)
    cache = KVCache.allocate(1, 256, BLOCK, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    tables = [list(range(r * 100, r * 100 + -(-c // BLOCK))) for r, (c, _) in enumerate(rows)]
    lens = [c for c, _ in rows], [n for _, n in rows]
    meta = AttentionMetadata.build(tables, *lens, BLOCK, torch.device("cpu"), sliding_window=window, use_kernel=False)
    (group,) = meta.groups
    assert group.causal is causal
    total = sum(n for _, n in rows)
    for table, (c, n) in zip(tables, rows):  # the cached part of a chunk at an offset
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - n)]
        cache.keys[0].view(-1, KV_HEADS, DIM)[slots] = torch.randn(len(slots), KV_HEADS, DIM)
        cache.values[0].view(-1, KV_HEADS, DIM)[slots] = torch.randn(len(slots), KV_HEADS, DIM)
    q, k, v = torch.randn(total, HEADS, DIM), torch.randn(total, KV_HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    out = paged_attention(q, k, v, cache.keys[0], cache.values[0], meta, DIM**-0.5)
    group.causal = False
    masked = paged_attention(q, k, v, cache.keys[0], cache.values[0], meta, DIM**-0.5)
    assert torch.equal(out, masked)
