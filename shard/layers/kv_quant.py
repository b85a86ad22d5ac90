"""8-bit KV cache rows (`--kv-cache-dtype int8`): one head's K or V of one token as int8 values and their scales.

A row is `head_dim` int8 values followed by a float16 scale for each group of 16 of them (absmax / 127), so an int8
pool is one int8 tensor per layer and side, [blocks, block_size, kv_heads, head_dim * 9 / 8], written and gathered
by slot exactly as a float pool is. A token's row is quantized once, when its step writes it, and never again as
its block fills. Groups of 16: a head's few outlier channels then set the step of their own group only. On
SmolLM2-135M-Instruct's accuracy text (benchmarks/accuracy.py) one scale per row of 64 left a mean KL from the
float cache of 0.00058, groups of 32 0.00025, groups of 16 0.00017 (llama.cpp's q8_0 cache, groups of 32 with its
own rounding: 0.00020). A row of a head of 64 takes 72 bytes where float32 takes 256 and bf16 128: the pool holds
3.6x (1.8x) the tokens in the same memory. Readers: the paged decode kernel reads the rows in place, each group
widened and scaled as it is loaded; the prefill paths gather a chunk's context and widen it here.
"""

from __future__ import annotations

import torch

from conveyor.shard.kernels import library as kernels

GROUP = 16  # values per scale
CHOICES = ("auto", "int8")  # --kv-cache-dtype: auto keeps the model's dtype
SMALLEST_SCALE = 2.0**-24  # float16's smallest subnormal: a row of zeros (or nearly) still divides by something


class KVCacheUnavailable(ValueError):
    """The KV cache asked for cannot hold this model (the shard exits with the reason)."""


def cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a --kv-cache-dtype choice."""
    if choice not in CHOICES:
        raise KVCacheUnavailable(f"--kv-cache-dtype must be one of {', '.join(CHOICES)}, not {choice!r}")
    return torch.int8 if choice == "int8" else model_dtype


def check_head_dim(head_dim: int, dtype: torch.dtype) -> None:
    """An int8 pool needs whole groups: every head size of the model families served is a multiple of 16."""
    if dtype == torch.int8 and head_dim % GROUP:
        raise KVCacheUnavailable(f"--kv-cache-dtype int8 needs a head size divisible by {GROUP}, not {head_dim}")


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cache row: the head's values, and for int8 the bytes of their scales after them."""
    return head_dim + head_dim // GROUP * 2 if dtype == torch.int8 else head_dim


def quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] of any float dtype as int8 rows [..., D * 9 / 8]: each group of 16 rounded against its own
    float16 scale (absmax / 127, rounded to float16 first, so the values are exact multiples of the stored scale)."""
    *lead, dim = x.shape
    groups = x.float().reshape(*lead, dim // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(SMALLEST_SCALE).half()
    values = torch.round(groups / scale.float()).clamp_(-127, 127).to(torch.int8).reshape(*lead, dim)
    return torch.cat([values, scale.reshape(*lead, dim // GROUP).view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D * 9 / 8] back to [..., D] in `dtype` (each value times its group's scale, in float32)."""
    *lead, width = rows.shape
    dim = width * GROUP // (GROUP + 2)
    scale = rows[..., dim:].contiguous().view(torch.float16).float()
    values = rows[..., :dim].float().reshape(*lead, dim // GROUP, GROUP) * scale[..., None]
    return values.reshape(*lead, dim).to(dtype)


def write(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Puts the new tokens' rows [T, Hkv, D] into their slots of `cache` ([blocks, block, Hkv, width]),
    quantizing them where the pool is int8 (in one C++ pass where the kernels serve: the same bits as `quantize`)."""
    if quantized(cache) and kernels.serves(cache.device):
        torch.ops.conveyor.kv_quant_write_(cache, slots, rows.contiguous())
        return
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, slots, quantize(rows) if quantized(cache) else rows)


def gather(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of `slots` from a flattened pool [slots, Hkv, width], as [S, Hkv, D] in `dtype` (an int8 pool's
    widened in one C++ pass where the kernels serve)."""
    if not quantized(flat):
        return flat.index_select(0, slots)
    if kernels.serves(flat.device):
        return torch.ops.conveyor.kv_quant_gather(flat, slots, dtype)
    return dequantize(flat.index_select(0, slots), dtype)
