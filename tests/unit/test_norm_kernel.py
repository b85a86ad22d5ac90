"""The RMSNorm kernel (`shard/kernels/rms_norm.cpp`) against the torch path it stands in for, both roundings
(Llama's family and Gemma's), every float dtype, the shapes the models give it (rows of the hidden size, and
[tokens, heads, head_dim] for q/k norms, a view of a fused projection), and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch

from conveyor.shard.kernels import library as kernels
from conveyor.shard.layers.norm import GemmaRMSNorm, RMSNorm


@pytest.fixture(scope="module")
def built() -> None:
    if not kernels.load():
        pytest.skip("the C++ kernels did not build here")


def both_paths(norm: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert norm.kernel
    kernel = norm(x)
    norm.kernel = False
    return kernel, norm(x)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 768), (5, 130), (300, 64), (7, 4, 32)], ids=str)
def test_the_kernel_equals_the_torch_path(built, gemma: bool, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Equal up to the last bit of float32 (the sum of squares is added in another order), which the rounding to
    bf16 or fp16 may carry into one unit of those."""
    generator = torch.Generator().manual_seed(len(shape) * shape[-1])
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    x = (3 * torch.randn(shape, generator=generator)).to(dtype)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(weight, 1e-6)
    kernel, reference = both_paths(norm, x)
    assert kernel.dtype == dtype and kernel.shape == x.shape
    step = {torch.float32: 4e-7, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert ((kernel.float() - reference.float()).abs() <= 2 * step * reference.float().abs().clamp(min=1)).all()


def test_a_view_of_a_fused_projection_is_read_as_its_values(built) -> None:
    """q/k norms get a slice of the fused q/k/v output: not contiguous."""
    fused = torch.randn(6, 3, 4, 32)
    x = fused[:, 0]
    assert not x.is_contiguous()
    norm = RMSNorm(torch.randn(32), 1e-5)
    kernel, reference = both_paths(norm, x)
    torch.testing.assert_close(kernel, reference)


def test_a_row_of_zeros_stays_zero(built) -> None:
    norm = RMSNorm(torch.ones(16), 1e-6)
    assert torch.equal(norm(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_the_switch_gives_the_norms_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ATTENTION", "torch")
    assert RMSNorm(torch.ones(8), 1e-6).kernel is False and GemmaRMSNorm(torch.ones(8), 1e-6).kernel is False
