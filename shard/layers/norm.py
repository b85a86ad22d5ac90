"""RMSNorm, computed in float32 whatever the model's dtype, as Llama-family checkpoints were trained; and Gemma's,
which scales by (1 + w) and rounds once, after the scaling."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.scale = 1.0 + weight.float()  # Gemma stores w with the 1 taken out
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.scale).to(x.dtype)
