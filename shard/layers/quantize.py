"""Quantization at load (`--quantize int8|int4`): what the linear layers keep instead of float weights.

int8: symmetric, q = round(w / s) in [-127, 127]. On a CPU with AVX-512 VNNI a float16 scale per block of 32 inputs,
s = max|w| / 127 over the block (`Int8BlockWeight`, llama.cpp's q8_0), for the integer kernel; elsewhere one float32
scale per output row (`Int8Weight`), for the widening kernel. int4: 4 bits and a float16 scale per 32 inputs
(`Int4Weight`, llama.cpp's q4_0). On a tensor-parallel rank the rows and columns it holds are quantized on their
own (a row-parallel slice's scales cover its part of the inputs only), which needs no communication. A weight takes
one byte (int8: plus 2 bytes per 32, or 4 per row) or half a byte plus 2 per 32 (int4) against float32's four.

On a CPU with AVX-512 VNNI each layer's input is rounded to int8 as well, with a float scale per block of 32 inputs
(as llama.cpp's q8_0), and each block's products are integer (`shard/kernels/int8_vnni_gemm.cpp`,
`int4_vnni_gemm.cpp`); elsewhere the kernels (`int8_gemm.cpp`, `int4_gemm.cpp`) widen each weight back to float as
they read it, so activations and sums stay in the model's dtype (`layers/gemm.py` chooses). Why blocks and not one
scale per row: a real model's activations carry a few outlier channels, which a row's single scale spends the 8
bits on. On SmolLM2-135M-Instruct, int8 with scales per 32 for both x and w moves the output from float32's far
less than a scale per row for each (`python -m benchmarks.accuracy --quantize int8` measures the mean KL
from float32 per token). The embedding table is int8 with a scale per row under either quantization (a lookup
widens only the rows it reads); norms stay in the model's dtype, being small.
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
INT8_GROUP_BLOCKS = 16  # blocks an Int8BlockWeight interleaves (one int32 lane each in the kernel)


def _groups(blocks: int) -> list[int]:
    """Int8BlockWeight's groups along a row of `blocks`: 16 blocks each, then the rest as its binary digits say
    (18 blocks: 16 and 2), so that every group but one of a single block fills whole 64-byte vectors."""
    full, rest = divmod(blocks, INT8_GROUP_BLOCKS)
    return [INT8_GROUP_BLOCKS] * full + [size for size in (8, 4, 2, 1) if rest & size]


def _group_order(values: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[out, blocks * 32] from natural order to Int8BlockWeight's grouped one (or back): in each group, bytes
    4k..4k+3 of each of its blocks in turn, then 4k+4..4k+7, and so on."""
    out, size = values.shape
    pieces, first = [], 0
    for n in _groups(size // INT8_BLOCK):
        group = values[:, first * INT8_BLOCK : (first + n) * INT8_BLOCK]
        shape = (out, INT8_BLOCK // 4, n, 4) if inverse else (out, n, INT8_BLOCK // 4, 4)
        pieces.append(group.reshape(shape).transpose(1, 2).reshape(out, n * INT8_BLOCK))
        first += n
    return torch.cat(pieces, dim=1)


@dataclass(frozen=True)
class Int8BlockWeight:
    """8 bits a weight, symmetric per block of 32 inputs with a float16 scale (q8_0): q = round(w / s) in
    [-127, 127], s = max|w| / 127 over the block, the input padded with zeros to whole blocks. Stored for
    `int8_vnni_gemm`, which multiplies unsigned bytes by x's signed ones: q + 128, each group of 16 blocks
    interleaved four bytes at a time (`_group_order`), so that one vector instruction sums four products of each of
    16 blocks into 16 lanes and the blocks' scales apply once per eight of them."""

    values: torch.Tensor  # uint8 [out, blocks * 32]: q + 128, grouped order
    scales: torch.Tensor  # float16 [out, blocks]
    in_features: int

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8BlockWeight:
        out, size = weight.shape
        blocks = -(-size // INT8_BLOCK)
        w = F.pad(weight.float(), (0, blocks * INT8_BLOCK - size)).view(out, blocks, INT8_BLOCK)
        scales = (w.abs().amax(dim=-1) / 127.0).half()
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
        q = torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int16) + 128
        values = _group_order(q.to(torch.uint8).view(out, blocks * INT8_BLOCK))
        return cls(values.contiguous(), scales.contiguous(), size)

    def dequantize(self) -> torch.Tensor:
        out, blocks = self.scales.shape
        q = _group_order(self.values, inverse=True).to(torch.int16) - 128
        w = q.view(out, blocks, INT8_BLOCK).float() * self.scales.float()[..., None]
        return w.view(out, blocks * INT8_BLOCK)[:, : self.in_features]

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
