"""Quantization at load (`--quantize int8|int4`): what the linear layers keep instead of float weights.

Symmetric, one float32 scale per output channel (row of the [out, in] weight): q = round(w / s), s = max|w| / 127.
On a tensor-parallel rank the rows and columns it holds are quantized on their own: a row-parallel slice has its
own per-row scales over its part of the inputs, which is as exact as quantizing the whole row and needs no
communication. The model's bytes per weight drop to one (plus 4 bytes per row), a quarter of float32's; int4's
to half a byte plus a float16 scale per 32. On a CPU with AVX-512 VNNI each layer's input is rounded to int8 as
well, a scale per row, and the products are integer (`shard/kernels/int8_vnni_gemm.cpp`, `int4_vnni_gemm.cpp`, as
llama.cpp's q8_0 and q4_0 do); elsewhere the kernels (`int8_gemm.cpp`, `int4_gemm.cpp`) widen each weight back to
float as they read it, so activations and sums stay in the model's dtype (`layers/gemm.py` chooses). The embedding
table is int8 under either quantization (a lookup widens only the rows it reads); norms stay in the model's
dtype, being small.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


INT4_GROUP = 32  # input elements per float16 scale, as llama.cpp's q4_0


@dataclass(frozen=True)
class Int4Weight:
    """4 bits a weight, symmetric per group of 32 inputs with a float16 scale: q = round(w / s) in [-8, 7],
    s = max|w| / 7 over the group. Byte j of a group holds q[j] + 8 in its low nibble and q[j + 16] + 8 in its
    high one (the layout `shard/kernels/int4_gemm.cpp` reads: both halves of x stay contiguous)."""

    packed: torch.Tensor  # uint8 [out, in / 2]
    scales: torch.Tensor  # float16 [out, in / 32]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        out, size = weight.shape
        if size % INT4_GROUP:
            raise QuantizationUnavailable(f"int4 needs input sizes divisible by {INT4_GROUP}, not {size}")
        groups = weight.float().view(out, size // INT4_GROUP, INT4_GROUP)
        scales = (groups.abs().amax(dim=-1) / 7.0).half()
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
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
