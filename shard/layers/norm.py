"""RMSNorm, computed in float32 whatever the model's dtype, as Llama-family checkpoints were trained; and Gemma's,
which scales by (1 + w) and rounds once, after the scaling. On CPU both run as one C++ kernel where the kernels
serve (`shard/kernels/rms_norm.cpp`, which says what it saves and what measures it), and the torch code below stays
the reference path and the GPU's."""

from __future__ import annotations

import torch

from conveyor.shard.kernels import library as kernels


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps
        self.kernel = kernels.serves(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == self.weight.dtype:
            return torch.ops.conveyor.rms_norm(x.contiguous(), self.weight, self.eps, False)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`hidden += delta` (the residual add, in place), then the norm of the sum: one C++ pass where the
        kernels serve, with torch's roundings."""
        if self.kernel and hidden.dtype == self.weight.dtype and hidden.is_contiguous() and delta.is_contiguous():
            return torch.ops.conveyor.add_rms_norm_(hidden, delta, self.weight, self.eps, False)
        return self(hidden.add_(delta))


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.scale = 1.0 + weight.float()  # Gemma stores w with the 1 taken out
        self.eps = eps
        self.kernel = kernels.serves(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            return torch.ops.conveyor.rms_norm(x.contiguous(), self.scale, self.eps, True)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale).to(x.dtype)
