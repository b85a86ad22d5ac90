"""Weight-only int8 quantization at load (`--quantize int8`): what the linear layers keep instead of float weights.

Symmetric, one float32 scale per output channel (row of the [out, in] weight): q = round(w / s), s = max|w| / 127.
On a tensor-parallel rank the rows and columns it holds are quantized on their own: a row-parallel slice has its
own per-row scales over its part of the inputs, which is as exact as quantizing the whole row and needs no
communication. The model's bytes per weight drop to one (plus 4 bytes per row), a quarter of float32's; the
kernel (`shard/kernels/int8_gemm.cpp`) widens each row back to float as it reads it, so activations and sums stay
in the model's dtype. Embeddings and norms stay in it too: a lookup reads one row per token, and norms are small.
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
