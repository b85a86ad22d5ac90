"""8-bit KV cache rows (shard/layers/kv_quant.py): the rounding per group of 16, the pool's layout and size, and its
round trip through the slots a step writes and a prefill gathers."""

from __future__ import annotations

import pytest
import torch

from conveyor import config
from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers import kv_quant
from conveyor.shard.layers.attention import KVCache


def test_each_group_rounds_to_its_own_scale() -> None:
    """Rows of 64: four groups of 16, each against its own float16 scale, whatever the row's magnitude."""
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 1e-3, 40.0])[:, None]
    x[0, 0, 16:32] *= 50  # an outlier group: its neighbours keep their own, finer step
    x[2, 1] = 0
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + 4 * 2)
    scales = rows[..., 64:].contiguous().view(torch.float16).float()  # [5, 3, 4]
    absmax = x.reshape(5, 3, 4, 16).abs().amax(-1)
    want = (absmax / 127).clamp_min(kv_quant.SMALLEST_SCALE).half().float()
    assert torch.equal(scales, want)
    assert rows[..., :64].abs().max() <= 127
    steps = scales.repeat_interleave(16, dim=-1)
    error = (kv_quant.dequantize(rows, torch.float32) - x).abs()
    assert (error <= steps * 0.51).all()  # half a step (and the scale's float16 rounding, which can clip at 127)
    assert scales[0, 0, 1] > 10 * scales[0, 0, 0]
    assert torch.equal(kv_quant.dequantize(rows, torch.float32)[2, 1], torch.zeros(64))  # a zero row stays zero


def test_the_largest_value_of_a_group_comes_back_to_float16_precision() -> None:
    x = torch.tensor([[0.5, -2.0, 1.0, 0.25] * 4])
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    assert back[0, 1].item() == pytest.approx(-2.0, rel=1e-3)
    assert torch.equal(torch.sign(back), torch.sign(x))


def test_a_head_size_must_hold_whole_groups() -> None:
    kv_quant.check_head_dim(80, torch.int8)
    kv_quant.check_head_dim(72, torch.float32)  # a float cache takes any size
    with pytest.raises(kv_quant.KVCacheUnavailable, match="divisible by 16"):
        kv_quant.check_head_dim(72, torch.int8)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_an_int8_pool_holds_more_tokens_in_the_same_bytes(model_dtype: torch.dtype) -> None:
    """SmolLM2's attention shape: 30 layers, 3 KV heads of 64."""
    full = KVCache.bytes_per_block(30, 16, 3, 64, model_dtype)
    int8 = KVCache.bytes_per_block(30, 16, 3, 64, torch.int8)
    assert int8 == 2 * 30 * 16 * 3 * 72
    assert full / int8 == pytest.approx(64 * model_dtype.itemsize / 72)  # 3.56x float32, 1.78x bf16
    cache = KVCache.allocate(2, 4, 16, 3, 64, torch.int8, torch.device("cpu"))
    assert cache.keys[0].shape == (4, 16, 3, 72) and cache.keys[0].dtype == torch.int8
    assert sum(t.numel() * t.element_size() for t in [*cache.keys, *cache.values]) == 4 * KVCache.bytes_per_block(
        2, 16, 3, 64, torch.int8
    )


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_rows_written_to_their_slots_come_back_from_a_gather(model_dtype: torch.dtype) -> None:
    cache = KVCache.allocate(1, 6, 4, 2, 32, torch.int8, torch.device("cpu"))
    new = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(3)).to(model_dtype)
    slots = torch.tensor([17, 3, 4, 22, 0])
    kv_quant.write(cache.keys[0], slots, new)
    flat = cache.keys[0].view(-1, 2, 36)
    got = kv_quant.gather(flat, slots, model_dtype)
    assert got.dtype == model_dtype and got.shape == new.shape
    torch.testing.assert_close(got.float(), new.float(), rtol=0, atol=new.float().abs().max().item() / 127)


def test_a_float_pool_is_written_and_gathered_as_it_is() -> None:
    cache = KVCache.allocate(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"))
    new = torch.randn(3, 2, 8)
    slots = torch.tensor([1, 6, 2])
    kv_quant.write(cache.values[0], slots, new)
    assert torch.equal(kv_quant.gather(cache.values[0].view(-1, 2, 8), slots, torch.float32), new)


def test_the_flag_offers_what_the_cache_knows() -> None:
    assert config.KV_CACHE_DTYPES == kv_quant.CHOICES
    assert kv_quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.cache_dtype("int8", torch.float32) == torch.int8
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_quant.cache_dtype("fp8", torch.float32)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_kernel_writes_the_bits_the_reference_writes(model_dtype: torch.dtype) -> None:
    """The C++ writer (kv_quant.cpp) against `quantize`: outlier groups, tiny and zero rows, every slot where the
    step put it and nothing else touched."""
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here")
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(9, 3, 64, generator=generator) * torch.logspace(-6, 2, 9)[:, None, None]
    rows[4, 1] = 0
    rows[2, 0, 5] = 300.0
    rows = rows.to(model_dtype)
    slots = torch.tensor([40, 3, 17, 0, 63, 22, 8, 9, 31])
    written = KVCache.allocate(1, 4, 16, 3, 64, torch.int8, torch.device("cpu")).keys[0].fill_(-5)
    torch.ops.conveyor.kv_quant_write_(written, slots, rows)
    want = torch.full_like(written, -5).view(-1, 3, 72)
    want[slots] = kv_quant.quantize(rows)
    assert torch.equal(written.view(-1, 3, 72), want)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_kernel_gathers_the_values_the_reference_gathers(model_dtype: torch.dtype) -> None:
    """The C++ gather (a prompt chunk's context, widened) against `dequantize` of the same rows: the same bits."""
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here")
    pool = KVCache.allocate(1, 4, 16, 3, 64, torch.int8, torch.device("cpu")).values[0]
    generator = torch.Generator().manual_seed(11)
    pool.copy_(kv_quant.quantize(torch.randn(4, 16, 3, 64, generator=generator) * 3))
    flat, slots = pool.view(-1, 3, 72), torch.tensor([5, 63, 0, 5, 17, 40])
    got = torch.ops.conveyor.kv_quant_gather(flat, slots, model_dtype)
    assert got.dtype == model_dtype and torch.equal(got, kv_quant.dequantize(flat[slots], model_dtype))
    assert torch.equal(kv_quant.gather(flat, slots, model_dtype), got)
