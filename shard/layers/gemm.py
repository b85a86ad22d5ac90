"""The matrix multiply behind every linear layer and the LM head: `x @ W.T (+ b)` by the fastest kernel at hand.

On CPU, torch's `F.linear` goes to MKL's sgemm, which on AMD processors takes a generic path: measured on this
machine's AVX2 EPYC at 32 rows, 24-28 GFLOP/s against 48-60 for oneDNN with the weight packed once into its
blocked layout (the same kernels vLLM's CPU build dispatches its linear layers to). So a CPU weight is packed for
oneDNN at load time, when oneDNN supports its dtype here (float32 always; bfloat16 only where oneDNN has bf16
kernels for the CPU, `conveyor.cpu.onednn_bf16`, else it refuses to pack it). Everything else (CUDA, half types
oneDNN can't pack, or `CONVEYOR_GEMM=torch`, the switch the benchmark uses to measure the difference) keeps
`F.linear`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from conveyor import cpu

BACKENDS = ("auto", "onednn", "torch")


def backend() -> str:
    """`CONVEYOR_GEMM`: auto (oneDNN where it can pack the weight), onednn, or torch (plain F.linear)."""
    chosen = os.environ.get("CONVEYOR_GEMM", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"CONVEYOR_GEMM must be one of {BACKENDS}, not {chosen!r}")
    return chosen


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can pack this weight on this machine."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu.onednn_bf16()


def kernel(weight: torch.Tensor) -> str:
    """Which kernel this weight gets, 'onednn' or 'torch' (F.linear), decided apart from the packing so that the
    tests can ask it for every CPU kind without packing a weight the real CPU could not."""
    chosen = backend()
    packs = chosen != "torch" and onednn_packs(weight)
    if chosen == "onednn" and not packs:
        raise ValueError(f"CONVEYOR_GEMM=onednn, but oneDNN cannot pack a {weight.dtype} weight on {weight.device}")
    return "onednn" if packs else "torch"


class Gemm:
    """One weight [out, in], ready for `x [T, in] -> [T, out]`: packed for oneDNN, or plain for F.linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = kernel(weight) == "onednn"
        self.dtype = weight.dtype
        # The packed copy replaces the plain one: no layer needs both, and the model's weights stay counted once.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight

    def dense(self) -> torch.Tensor:
        """The weight as a plain [out, in] tensor, whatever its layout."""
        return self.weight.to_dense() if self.packed else self.weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, bias)
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1]), bias).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, bias, "none", [], "")
