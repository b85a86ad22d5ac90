"""Tensor-parallel linear layers.

A column-parallel layer splits its output features across ranks, so each rank computes its own slice and no
communication is needed; fused projections (QKV, gate/up) concatenate each part's slice, so a rank's output is
[its q heads | its k heads | its v heads]. A row-parallel layer splits its input features: each rank computes a
partial sum, and an all-reduce adds them up.
"""

from __future__ import annotations

import torch

from conveyor.shard.distributed import ProcessGroup
from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.weights import Weights


class ColumnParallelLinear(torch.nn.Module):
    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, plain_copy: bool = True, quantize: str | None = None
    ) -> None:
        super().__init__()
        self.gemm = Gemm(weight, plain_copy, quantize)
        self.bias = bias

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str], bias: bool) -> ColumnParallelLinear:
        """This rank's slice of each `prefix`.weight, stacked in order into one fused projection."""
        weight = torch.cat([weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes])
        b = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes]) if bias else None
        return cls(weight, b, weights.plain_copies, weights.quantize)

    @classmethod
    def load_fused(cls, weights: Weights, prefix: str, sizes: list[int]) -> ColumnParallelLinear:
        """A projection the checkpoint already stores fused (`prefix`.weight stacks parts of `sizes` rows, no
        bias), sliced per part so that a rank gets the same layout as from `load`."""
        return cls(weights.get_sharded_parts(f"{prefix}.weight", sizes), None, weights.plain_copies, weights.quantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)


class RowParallelLinear(torch.nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup,
        plain_copy: bool = True,
        quantize: str | None = None,
    ) -> None:
        super().__init__()
        self.gemm = Gemm(weight, plain_copy, quantize)
        self.bias = bias
        self.group = group

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool) -> RowParallelLinear:
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        bias_tensor = weights.get(f"{prefix}.bias") if bias else None
        return cls(weight, bias_tensor, weights.group, weights.plain_copies, weights.quantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(self.gemm(x))
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum
