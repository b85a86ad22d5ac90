"""A decode step's layers in one C++ call (`shard/kernels/decode_stack.cpp` says why): the layers' weights are bound
to a `torch.classes.conveyor.DecodeStack` once, when the model loads, and a step of decode rows runs through it with
no Python between the ops. Python keeps the collectives: with several ranks the stack runs half a layer per call and
the all-reduce of each half's partial sum runs here, between the calls.

It serves a step when every row decodes one token (the paged decode kernel's group alone), no LoRA adapter is
resident (its updates are added in Python, `shard/adapters/served_adapters.py`), no bf16 layer would widen its
rows to float32 (many rows, `Gemm.widen_rows`) and no int8 layer would take its oneDNN copy (`gemm.TILE_ROWS`).
Everything else, and `CONVEYOR_DECODE=layers`, runs the model's own modules, which stay the reference: the same
kernels, called one by one, give the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers.attention import DecodeGroup, KVCache
from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from conveyor.shard.runtime.process_group import ProcessGroup

SWITCH = "CONVEYOR_DECODE"  # fused (the default: one call per step) or layers (the Python modules)
CHOICES = ("fused", "layers")
DENSE, INT8, INT4 = 0, 1, 2  # decode_stack.cpp's Kind


def chosen() -> str:
    value = os.environ.get(SWITCH, "fused")
    if value not in CHOICES:
        raise ValueError(f"{SWITCH} must be one of {CHOICES}, not {value!r}")
    return value


@dataclass
class LayerParts:
    """What the stack needs of one pre-norm decoder layer (the Llama family's)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None
    qkv: ColumnParallelLinear
    o_proj: RowParallelLinear
    gate_up: ColumnParallelLinear
    down: RowParallelLinear

    @property
    def linears(self) -> tuple[ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear]:
        return self.qkv, self.o_proj, self.gate_up, self.down


def _linear_args(gemm: Gemm, bias: torch.Tensor | None) -> tuple:
    """`DecodeStack.add_linear`'s arguments for one layer's GEMM: the kernel Gemm would call, and what it reads."""
    if gemm.int8 is not None:
        return INT8, None, 0, gemm.int8.values, False, gemm.int8.scales, bias
    if gemm.int4 is not None:
        return INT4, None, 0, gemm.int4.packed, False, gemm.int4.scales, bias
    return DENSE, gemm.plain, gemm.small_rows, gemm.weight, gemm.packed, None, bias


@dataclass(frozen=True)
class StackShape:
    """One rank's attention heads and the constants every layer shares."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float  # the norms'
    scale: float  # the attention scores'


class DecodeStack:
    """The bound layers of one model on one rank, and when they may serve a step."""

    def __init__(self, parts: list[LayerParts], shape: StackShape, group: ProcessGroup) -> None:
        self.stack = torch.classes.conveyor.DecodeStack(
            shape.heads, shape.kv_heads, shape.head_dim, shape.eps, shape.scale
        )
        self.parts = parts
        self.group = group
        # With several ranks a row-parallel bias is added after the all-reduce, here; with one, in the GEMM.
        self.row_biases = [(p.o_proj.bias, p.down.bias) for p in parts] if group.world_size > 1 else None
        for p in parts:
            self.stack.add_layer(p.input_norm, p.post_norm, *(p.qk_norms or (None, None)))
            for linear in p.linears:
                in_gemm = linear.bias if self.row_biases is None or isinstance(linear, ColumnParallelLinear) else None
                self.stack.add_linear(*_linear_args(linear.gemm, in_gemm))
        # From this many rows some bf16 layer computes in float32 (Gemm.widen_rows), which the stack does not call.
        widen = [linear.gemm.widen_rows for p in parts for linear in p.linears if linear.gemm.widen_rows is not None]
        self.widen_rows = min(widen, default=None)
        # From this many rows int8 layers go through oneDNN's tiles (gemm.TILE_ROWS), which the stack does not call.
        tiles = [linear.gemm.tile_rows for p in parts for linear in p.linears if linear.gemm.tiles is not None]
        self.tile_rows = min(tiles, default=None)

    @classmethod
    def build(
        cls, parts: list[LayerParts], shape: StackShape, group: ProcessGroup, device: torch.device
    ) -> DecodeStack | None:
        """The stack, or None where it cannot serve: off the CPU, without the kernels, or switched off."""
        if chosen() != "fused" or not kernels.serves(device):
            return None
        return cls(parts, shape, group)

    def serves(self, rows: int, groups: list) -> bool:
        """Whether a step of `rows` tokens with these attention groups runs here."""
        if len(groups) != 1 or not isinstance(groups[0], DecodeGroup) or groups[0].token_index.numel() != rows:
            return False
        if self.widen_rows is not None and rows >= self.widen_rows:
            return False
        if self.tile_rows is not None and rows >= self.tile_rows:
            return False
        return all(linear.lora is None for p in self.parts for linear in p.linears)

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        group: DecodeGroup,
    ) -> torch.Tensor:
        """Runs every layer over `hidden` [rows, size] (its residual adds in place); returns the last layer's MLP
        output, which `hidden` still owes."""
        args = (cos, sin, cache.keys, cache.values, slots, group.block_tables, group.context_lens, group.window)
        if self.row_biases is None:
            return self.stack.run(hidden, None, *args, 0, self.stack.halves())
        delta = None
        for half in range(self.stack.halves()):
            delta = self.group.all_reduce(self.stack.run(hidden, delta, *args, half, half + 1))
            bias = self.row_biases[half // 2][half % 2]
            if bias is not None:
                delta = delta + bias
        return delta
