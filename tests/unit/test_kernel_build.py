"""The kernels' build: the switch, the fallback where nothing can be built, and a folder per CPU kind."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conveyor import cpu
from conveyor.shard.kernels import build as kernels
from conveyor.shard.layers.attention import AttentionGroup, AttentionMetadata, decode_kernel
from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.layers.norm import RMSNorm


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`load` asked anew, building into an empty cache folder, as in a process that has not loaded the kernels."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", lambda: False)
    kernels.load.cache_clear()
    yield
    kernels.load.cache_clear()


def test_no_compiler_means_the_torch_path(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # what cpp_extension compiles with
    monkeypatch.delenv("CONVEYOR_ATTENTION", raising=False)
    assert kernels.load() is False
    assert decode_kernel(torch.device("cpu")) is False
    meta = AttentionMetadata.build([[1]], [3], [1], 16, torch.device("cpu"))
    assert isinstance(meta.groups[0], AttentionGroup)
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    assert Gemm(torch.randn(8, 4)).plain is None  # one or two rows take oneDNN too
    assert RMSNorm(torch.ones(8), 1e-6).kernel is False


def test_insisting_on_the_kernel_fails_where_it_cannot_build(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("CONVEYOR_ATTENTION", "kernel")
    with pytest.raises(kernels.KernelUnavailable):
        kernels.load()


def test_the_switch_turns_the_kernel_off_without_building(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ATTENTION", "torch")
    monkeypatch.setattr(kernels, "_build", lambda: pytest.fail("built although switched off"))
    assert decode_kernel(torch.device("cpu")) is False
    monkeypatch.setenv("CONVEYOR_ATTENTION", "fast")
    with pytest.raises(ValueError, match="CONVEYOR_ATTENTION"):
        kernels.load()


def test_gpu_rows_never_take_the_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: True)
    assert decode_kernel(torch.device("cuda", 0)) is False
    assert decode_kernel(torch.device("cpu")) is True


def test_another_cpu_kind_builds_in_another_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    here = cpu.probe()
    monkeypatch.setattr(cpu, "probe", lambda: here)
    mine = kernels.build_folder()
    monkeypatch.setattr(cpu, "probe", lambda: replace(here, flags=here.flags ^ {"avx512_bf16"}))
    assert kernels.build_folder() != mine
