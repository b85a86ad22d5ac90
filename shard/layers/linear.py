"""Tensor-parallel linear layers.

A column-parallel layer splits its output features across ranks, so each rank computes its own slice and no
communication is needed; fused projections (QKV, gate/up) concatenate each part's slice, so a rank's output is
[its q heads | its k heads | its v heads]. A row-parallel layer splits its input features: each rank computes a
partial sum, and an all-reduce adds them up.

Either may carry a LoRA site (`shard/adapters/served_adapters.py`), which adds the update of each token's adapter
to the layer's output: to a column-parallel layer's slice, and to a row-parallel layer's partial sum before the
all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.runtime.process_group import ProcessGroup
from conveyor.shard.runtime.weights import Weights


class ColumnParallelLinear(torch.nn.Module):
    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        plain_copy: bool = True,
        quantize: str | None = None,
        parts: tuple[int, ...] | None = None,
        fused: bool = False,
    ) -> None:
        """`parts`: this rank's rows of each projection the layer fuses (q, k, v; gate, up), and `fused`: whether
        the checkpoint stores them as one tensor; where a LoRA adapter's rows go
        (`shard/adapters/served_adapters.py`)."""
        super().__init__()
        self.gemm = Gemm(weight, plain_copy, quantize)
        self.bias = bias
        self.parts = parts or (weight.shape[0],)
        self.fused = fused
        self.lora: Any = None  # its LoRA site, where the engine serves adapters

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str], bias: bool) -> ColumnParallelLinear:
        """This rank's slice of each `prefix`.weight, stacked in order into one fused projection."""
        pieces = [weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes]
        b = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes]) if bias else None
        parts = tuple(piece.shape[0] for piece in pieces)
        return cls(torch.cat(pieces), b, weights.plain_copies, weights.quantize, parts)

    @classmethod
    def load_fused(cls, weights: Weights, prefix: str, sizes: list[int]) -> ColumnParallelLinear:
        """A projection the checkpoint already stores fused (`prefix`.weight stacks parts of `sizes` rows, no
        bias), sliced per part so that a rank gets the same layout as from `load`."""
        weight = weights.get_sharded_parts(f"{prefix}.weight", sizes)
        parts = tuple(size // weights.group.world_size for size in sizes)
        return cls(weight, None, weights.plain_copies, weights.quantize, parts, fused=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gemm(x, self.bias)
        if self.lora is not None:
            self.lora(x, out)
        return out


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
        self.lora: Any = None  # its LoRA site, where the engine serves adapters

    @classmethod
    def load(cls, weights: Weights, prefix: str, bias: bool) -> RowParallelLinear:
        weight = weights.get_sharded(f"{prefix}.weight", dim=1)
        bias_tensor = weights.get(f"{prefix}.bias") if bias else None
        return cls(weight, bias_tensor, weights.group, weights.plain_copies, weights.quantize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.gemm(x)
        if self.lora is not None:
            self.lora(x, out)  # this rank's part of the update: the all-reduce sums them too
        out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum
