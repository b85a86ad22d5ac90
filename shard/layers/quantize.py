"""Quantization at load (`--quantize int8|int4`): what the linear layers keep instead of float weights.

int8: symmetric, q = round(w / s) in [-127, 127] with a float16 scale per block of 32 inputs, s = max|w| / 127 over
the block (`Int8BlockWeight`, llama.cpp's q8_0 weights). int4: 4 bits and a float16 scale per 32 inputs
(`Int4Weight`, llama.cpp's q4_0). Both kernels widen each weight back to float as they read it, against x in float
on every CPU kind, so answers do not depend on the CPU (`int8_gemm.cpp` and `int4_gemm.cpp` say why x is not rounded
to int8 as well: it changed the real model's greedy answers). On a tensor-parallel rank the rows and columns it holds
are quantized on their own (a row-parallel slice's scales cover its part of the inputs only), which needs no
communication. A weight takes one byte plus 2 per 32 (int8) or half a byte plus 2 per 32 (int4) against float32's
four.

Why blocks and not one scale per row: a real model's weights carry a few outliers, which a row's single scale spends
the 8 bits on (`python -m benchmarks.accuracy --quantize int8 int4` measures the KL from float32 per token, mean, p99
and max). The embedding table is int8 with a scale per row (`Int8Weight`) under either quantization (a lookup widens
only the rows it reads); norms stay in the model's dtype, being small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class QuantizationUnavailable(RuntimeError):
    """--quantize asked for where it cannot run: said at start, not at the first request."""


@dataclass(frozen=True)
class Int8Weight:
    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float32 [out]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.float()
        scales = w.abs().amax(dim=1) / 127.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
        values = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(values.contiguous(), scales.contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


INT8_BLOCK = 32  # input elements per float16 scale of an Int8BlockWeight, as llama.cpp's q8_0


@dataclass(frozen=True)
class Int8BlockWeight:
    """8 bits a weight, symmetric per block of 32 inputs with a float16 scale (q8_0): q = round(w / s) in
    [-127, 127], s = max|w| / 127 over the block (a last block cut short has its own). Stored as they come, [out,
    in], for `int8_gemm`, which widens and scales each block once per call for every row of x."""

    values: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # float16 [out, ceil(in / 32)]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8BlockWeight:
        out, size = weight.shape
        blocks = -(-size // INT8_BLOCK)
        w = F.pad(weight.float(), (0, blocks * INT8_BLOCK - size)).view(out, blocks, INT8_BLOCK)
        scales = (w.abs().amax(dim=-1) / 127.0).half()
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
        q = torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.view(out, blocks * INT8_BLOCK)[:, :size].contiguous(), scales.contiguous())

    def dequantize(self) -> torch.Tensor:
        steps = self.scales.float().repeat_interleave(INT8_BLOCK, dim=1)[:, : self.values.shape[1]]
        return self.values.float() * steps

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


INT4_GROUP = 32  # input elements per float16 scale, as llama.cpp's q4_0


@dataclass(frozen=True)
class Int4Weight:
    """4 bits a weight, symmetric per group of 32 inputs with a float16 scale (llama.cpp's q4_0): q = round(w / s)
    in [-8, 7], s = -m / 8 where m is the group's value of largest magnitude, sign and all. m itself is q = -8
    exactly, and the step is max|w| / 8, where s = max|w| / 7 left -8 unused: on SmolLM2-135M-Instruct that lowered
    int4's mean KL from float32 (`python -m benchmarks.accuracy --quantize int4`). Byte j of a group holds
    q[j] + 8 in its low nibble and q[j + 16] + 8 in its high one (the layout `shard/kernels/int4_gemm.cpp` reads:
    both halves of x stay contiguous)."""

    packed: torch.Tensor  # uint8 [out, in / 2]
    scales: torch.Tensor  # float16 [out, in / 32]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        out, size = weight.shape
        if size % INT4_GROUP:
            raise QuantizationUnavailable(f"int4 needs input sizes divisible by {INT4_GROUP}, not {size}")
        groups = weight.float().view(out, size // INT4_GROUP, INT4_GROUP)
        extreme = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scales = (extreme / -8.0).half()
        scales = torch.where(scales != 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
        q = torch.round(groups / scales.float()[..., None]).clamp(-8, 7).to(torch.int16) + 8
        half = INT4_GROUP // 2
        packed = (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8).reshape(out, size // 2)
        return cls(packed.contiguous(), scales.contiguous())

    def dequantize(self) -> torch.Tensor:
        out = self.packed.shape[0]
        half = INT4_GROUP // 2
        bytes_ = self.packed.view(out, -1, half).to(torch.int16)
        q = torch.cat([(bytes_ & 15) - 8, (bytes_ >> 4) - 8], dim=-1).float()
        return (q * self.scales.float()[..., None]).reshape(out, -1)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes
