"""The C++ paged decode kernel against the torch reference path, and the fallback where it cannot build."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import kv_quant
from conveyor.shard.layers.attention import AttentionMetadata, DecodeGroup, KVCache, paged_attention

BLOCK, HEADS, KV_HEADS, DIM = 16, 6, 2, 64
# Decode rows at block boundaries and between them; prompt chunks, one of them after a prefix hit (its context
# already holds 40 tokens it did not compute in this forward).
DECODE_LENGTHS = [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 1, 37, 100, 255]
CHUNKS = [(24, 24), (56, 16), (60, 20)]  # (context after this forward, new tokens)


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here (the fallback tests below cover that)")


def stale_pool(
    lengths: list[int], kv_heads: int, dim: int, dtype: torch.dtype, rng: random.Random, spare: int
) -> tuple[KVCache, list[list[int]]]:
    """A pool of random numbers (stale ones from earlier requests in the slots nobody owns now) and a block table
    of shuffled blocks for each context length, `spare` blocks left over. `dtype` int8: 8-bit rows."""
    needed = sum(-(-c // BLOCK) for c in lengths)
    cache = KVCache.allocate(1, needed + spare, BLOCK, kv_heads, dim, dtype, torch.device("cpu"))
    for pool in (cache.keys[0], cache.values[0]):
        pool.copy_(kv_quant.quantize(torch.randn(*pool.shape[:-1], dim)) if dtype == torch.int8 else pool.normal_())
    free = list(range(needed + spare))
    rng.shuffle(free)
    return cache, [[free.pop() for _ in range(-(-c // BLOCK))] for c in lengths]


def run(
    dtype: torch.dtype,
    use_kernel: bool,
    window: int | None,
    seed: int,
    softcap: float = 0.0,
    cache_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One forward's attention over random block tables (shuffled blocks, a stale pool) on either path; the pool in
    `cache_dtype` (default: `dtype`)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = [(c, 1) for c in DECODE_LENGTHS] + CHUNKS
    rng.shuffle(rows)
    cache, tables = stale_pool([c for c, _ in rows], KV_HEADS, DIM, cache_dtype or dtype, rng, spare=8)
    total = sum(n for _, n in rows)
    q = torch.randn(total, HEADS, DIM, dtype=dtype)
    k = torch.randn(total, KV_HEADS, DIM, dtype=dtype)
    v = torch.randn(total, KV_HEADS, DIM, dtype=dtype)
    lengths, news = [c for c, _ in rows], [n for _, n in rows]
    meta = AttentionMetadata.build(tables, lengths, news, BLOCK, torch.device("cpu"), window, use_kernel=use_kernel)
    assert isinstance(meta.groups[0], DecodeGroup) == use_kernel
    return paged_attention(q, k, v, cache.keys[0], cache.values[0], meta, DIM**-0.5, softcap)


# An int8 pool (8-bit rows, layers/kv_quant.py): the reference widens the rows it gathers (to bf16 for a bf16
# query, which rounds them again), the kernel folds each row's scale into its score and its weight.
DTYPES = [
    (torch.float32, None, 1e-4),
    (torch.bfloat16, None, 2e-2),
    (torch.float32, torch.int8, 1e-4),
    (torch.bfloat16, torch.int8, 2e-2),
]
DTYPE_IDS = ["float32", "bfloat16", "float32-int8-cache", "bfloat16-int8-cache"]


@pytest.mark.parametrize("softcap", [0.0, 0.5], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "sliding-window"])
# float32 within 1e-4: the prompt chunks' rows go through torch's own attention on both paths, grouped
# differently, and one process in ten or so sums them differently by up to 3e-5 (measured with the soft cap);
# the decode rows the kernel computes agree with the reference within 3e-7.
@pytest.mark.parametrize(("dtype", "cache_dtype", "tolerance"), DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_the_reference_path(
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
    tolerance: float,
    window: int | None,
    seed: int,
    softcap: float,
) -> None:
    reference = run(dtype, use_kernel=False, window=window, seed=seed, softcap=softcap, cache_dtype=cache_dtype)
    kernel = run(dtype, use_kernel=True, window=window, seed=seed, softcap=softcap, cache_dtype=cache_dtype)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_a_batch_of_decode_rows_only_takes_the_kernel_alone() -> None:
    meta = AttentionMetadata.build([[3], [1, 2]], [5, 20], [1, 1], BLOCK, torch.device("cpu"), use_kernel=True)
    (group,) = meta.groups
    assert isinstance(group, DecodeGroup)
    assert group.context_lens.tolist() == [5, 20] and group.block_tables.tolist() == [[3, 0], [1, 2]]


# (query heads, KV heads, head size): GQA groups of 1, 3, 5 and 8 rows (the SIMD loops keep sixteen vectors of
# sums, 4 rows of a head of 64 and 2 of 128 in AVX-512, half that in AVX2, so these leave remainders), and a head
# of 80, which only the portable loops serve.
SHAPES = [(4, 4, 64), (6, 2, 64), (10, 2, 64), (8, 1, 64), (6, 2, 128), (10, 2, 128), (6, 2, 80)]
# The default op runs the widest loops the CPU has (AVX-512's, or AVX2's); the AVX2 and portable ones are called
# by name, so each runs here whatever the CPU.
OPS = ["paged_decode_attention", "paged_decode_attention_avx2", "paged_decode_attention_portable"]


@pytest.mark.parametrize("op", OPS, ids=["default", "avx2", "portable"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES, ids=[f"{h}x{k}x{d}" for h, k, d in SHAPES])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "tolerance"),
    [(torch.float32, None, 1e-5), (torch.bfloat16, None, 2e-2), (torch.float32, torch.int8, 1e-5)],
    ids=["float32", "bfloat16", "float32-int8-cache"],
)
def test_each_loop_equals_the_reference_at_every_head_shape(
    op: str, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None, tolerance: float
) -> None:
    """Each of the kernel's loops against the torch path, on decode rows whose contexts end at every place within
    sixteen tokens and a block."""
    torch.manual_seed(dim + heads)
    lengths = DECODE_LENGTHS + [33, 47, 64, 97]
    cache, tables = stale_pool(lengths, kv_heads, dim, cache_dtype or dtype, random.Random(dim), spare=4)
    q = torch.randn(len(lengths), heads, dim, dtype=dtype)
    k = torch.randn(len(lengths), kv_heads, dim, dtype=dtype)
    v = torch.randn(len(lengths), kv_heads, dim, dtype=dtype)
    news = [1] * len(lengths)
    reference_meta = AttentionMetadata.build(tables, lengths, news, BLOCK, torch.device("cpu"), use_kernel=False)
    # The reference writes this step's K/V into the pool, where the kernel then reads them.
    reference = paged_attention(q, k, v, cache.keys[0], cache.values[0], reference_meta, dim**-0.5)
    (group,) = AttentionMetadata.build(tables, lengths, news, BLOCK, torch.device("cpu"), use_kernel=True).groups
    kernel = getattr(torch.ops.conveyor, op)(
        q, cache.keys[0], cache.values[0], group.block_tables, group.context_lens, dim**-0.5, 0, 0.0
    )
    torch.testing.assert_close(
        kernel.reshape(len(lengths), -1).float(), reference.float(), rtol=tolerance, atol=tolerance
    )
