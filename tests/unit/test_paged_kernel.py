"""The C++ paged decode kernel against the torch reference path, and the fallback where it cannot build."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor.shard.kernels import build as kernels
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


def run(dtype: torch.dtype, use_kernel: bool, window: int | None, seed: int, softcap: float = 0.0) -> torch.Tensor:
    """One forward's attention over random block tables (shuffled blocks, a stale pool) on either path."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = [(c, 1) for c in DECODE_LENGTHS] + CHUNKS
    rng.shuffle(rows)
    needed = sum(-(-c // BLOCK) for c, _ in rows)
    cache = KVCache.allocate(1, needed + 8, BLOCK, KV_HEADS, DIM, dtype, torch.device("cpu"))
    cache.keys[0].normal_()  # stale numbers from earlier requests in the slots nobody owns now
    cache.values[0].normal_()
    free = list(range(needed + 8))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // BLOCK))] for c, _ in rows]
    total = sum(n for _, n in rows)
    q = torch.randn(total, HEADS, DIM, dtype=dtype)
    k = torch.randn(total, KV_HEADS, DIM, dtype=dtype)
    v = torch.randn(total, KV_HEADS, DIM, dtype=dtype)
    lengths, news = [c for c, _ in rows], [n for _, n in rows]
    meta = AttentionMetadata.build(tables, lengths, news, BLOCK, torch.device("cpu"), window, use_kernel=use_kernel)
    assert isinstance(meta.groups[0], DecodeGroup) == use_kernel
    return paged_attention(q, k, v, cache.keys[0], cache.values[0], meta, DIM**-0.5, softcap)


@pytest.mark.parametrize("softcap", [0.0, 0.5], ids=["uncapped", "soft-capped"])
@pytest.mark.parametrize("window", [None, 20], ids=["full", "sliding-window"])
@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["float32", "bfloat16"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_the_reference_path(
    dtype: torch.dtype, tolerance: float, window: int | None, seed: int, softcap: float
) -> None:
    reference = run(dtype, use_kernel=False, window=window, seed=seed, softcap=softcap)
    kernel = run(dtype, use_kernel=True, window=window, seed=seed, softcap=softcap)
    torch.testing.assert_close(kernel.float(), reference.float(), rtol=tolerance, atol=tolerance)


def test_a_batch_of_decode_rows_only_takes_the_kernel_alone() -> None:
    meta = AttentionMetadata.build([[3], [1, 2]], [5, 20], [1, 1], BLOCK, torch.device("cpu"), use_kernel=True)
    (group,) = meta.groups
    assert isinstance(group, DecodeGroup)
    assert group.context_lens.tolist() == [5, 20] and group.block_tables.tolist() == [[3, 0], [1, 2]]
