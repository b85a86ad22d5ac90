"""The prefill attention kernel (shard/kernels/prefill_attention.cpp) against SDPA with an explicit causal mask,
for each of its SIMD widths: GQA groups of several sizes, chunks at an offset in their context, lengths that end
inside a key tile and inside a block of query rows, and the smallest cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.shard.kernels import library as kernels

OPS = ["prefill_attention", "prefill_attention_avx2"]


@pytest.fixture(scope="module", autouse=True)
def kernel_built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here (the torch path serves)")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Query i of a chunk of Q at the end of a context of C sees keys 0..C-Q+i."""
    start = keys.shape[0] - q.shape[0]
    positions = torch.arange(start, keys.shape[0])
    mask = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (16, 2, 32), (6, 3, 8)])
@pytest.mark.parametrize(("context", "queries"), [(300, 300), (1000, 257), (129, 64), (5, 5), (40, 2), (1, 1)])
def test_kernel_equals_masked_sdpa(op: str, heads: int, kv_heads: int, dim: int, context: int, queries: int) -> None:
    torch.manual_seed(context * 31 + queries + heads)
    q = torch.randn(queries, heads, dim)
    keys, values = torch.randn(context, kv_heads, dim), torch.randn(context, kv_heads, dim)
    scale = dim**-0.5
    out = getattr(torch.ops.conveyor, op)(q, keys, values, scale)
    torch.testing.assert_close(out, reference(q, keys, values, scale), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("op", OPS)
def test_large_scores_stay_finite(op: str) -> None:
    """Scores of hundreds (a sharp softmax) keep the running max exact: no overflow, no NaN."""
    torch.manual_seed(1)
    q = torch.randn(200, 4, 16) * 30
    keys, values = torch.randn(260, 2, 16) * 30, torch.randn(260, 2, 16)
    out = getattr(torch.ops.conveyor, op)(q, keys, values, 0.25)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, keys, values, 0.25), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("context", "queries"), [(300, 300), (1000, 257), (129, 64), (5, 5), (1, 1)])
def test_the_paged_kernel_reads_the_pool_in_place_with_the_same_bits(op: str, context: int, queries: int) -> None:
    """Over a pool, the context's rows scattered in it: the same output as the kernel over the gathered rows."""
    torch.manual_seed(context + queries)
    heads, kv_heads, dim, pool_rows = 8, 2, 64, 1200
    q = torch.randn(queries, heads, dim)
    key_pool, value_pool = torch.randn(pool_rows, kv_heads, dim), torch.randn(pool_rows, kv_heads, dim)
    slots = torch.randperm(pool_rows)[:context]
    paged = getattr(torch.ops.conveyor, op.replace("prefill_attention", "prefill_attention_paged"))
    out = paged(q, key_pool, value_pool, slots, dim**-0.5)
    gathered = getattr(torch.ops.conveyor, op)(q, key_pool[slots], value_pool[slots], dim**-0.5)
    assert torch.equal(out, gathered)
    torch.testing.assert_close(out, reference(q, key_pool[slots], value_pool[slots], dim**-0.5), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (torch.tensor([0, 1, 40]), "slots within the pool"),
        (torch.tensor([0, -1, 2]), "slots within the pool"),
        (torch.tensor([0, 1]), "the context holds the chunk"),
        (torch.tensor([0, 1, 2], dtype=torch.int32), "slots: \\[C\\] int64"),
    ],
)
def test_the_paged_kernel_refuses_slots_outside_its_pool(slots: torch.Tensor, message: str) -> None:
    pool = torch.randn(40, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.conveyor.prefill_attention_paged(torch.randn(3, 2, 8), pool, pool, slots, 1.0)


def test_a_chunk_longer_than_its_context_is_refused() -> None:
    with pytest.raises(RuntimeError, match="the context holds the chunk"):
        torch.ops.conveyor.prefill_attention(torch.randn(8, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), 1.0)
