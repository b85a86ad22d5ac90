"""The shard's device choice (one function, so the CPU-only CI checks every branch but the GPU itself) and the
oneDNN GEMM every CPU linear layer runs on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor import cpu
from conveyor.shard.layers.gemm import Gemm, onednn_packs
from conveyor.shard.runtime.device import DeviceUnavailable, choose_device, to_device


def test_auto_picks_the_cpu_on_this_machine():
    assert choose_device("auto", rank=0) == torch.device("cpu")


@pytest.mark.parametrize("rank, expected", [(0, "cuda:0"), (1, "cuda:1"), (2, "cuda:0"), (3, "cuda:1")])
def test_auto_and_cuda_give_each_rank_its_own_gpu(rank: int, expected: str):
    assert choose_device("auto", rank, cuda_devices=2) == torch.device(expected)
    assert choose_device("cuda", rank, cuda_devices=2) == torch.device(expected)


def test_cpu_is_taken_when_asked_even_beside_gpus():
    assert choose_device("cpu", 1, cuda_devices=4) == torch.device("cpu")


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(DeviceUnavailable, match="no CUDA device"):
        choose_device("cuda", 0, cuda_devices=0)
    with pytest.raises(DeviceUnavailable, match="must be one of"):
        choose_device("tpu", 0, cuda_devices=0)


def test_host_tensors_stay_put_on_the_cpu():
    values = torch.arange(5)
    assert to_device(values, torch.device("cpu")) is values


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
def test_packed_gemm_matches_f_linear(rows: int):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    gemm = Gemm(weight)
    assert gemm.packed == onednn_packs(weight)  # float32 on a CPU: packed wherever torch has oneDNN
    assert torch.equal(gemm.dense(), weight)
    torch.testing.assert_close(gemm(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemm(x[None]), F.linear(x, weight)[None], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bf16_kernels", ["as this run has them", "switched off"])
def test_bf16_gemm_is_correct_on_either_kernel(monkeypatch: pytest.MonkeyPatch, bf16_kernels: str):
    """bf16 weights take oneDNN where it has bf16 kernels, F.linear elsewhere: switched off, a Xeon runs the
    EPYC's path, so both are checked wherever oneDNN has them (on an EPYC, both cases take F.linear)."""
    if bf16_kernels == "switched off":
        monkeypatch.setenv(cpu.BF16_SWITCH, "0")
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(32, 64, generator=gen)
    weight, bias, x = weight.bfloat16(), bias.bfloat16(), x.bfloat16()
    gemm = Gemm(weight)
    assert gemm.packed == cpu.onednn_bf16()
    exact = F.linear(x.float(), weight.float(), bias.float())  # the same bf16 values, multiplied in float32
    torch.testing.assert_close(gemm(x, bias).float(), exact, rtol=1e-2, atol=5e-2)


def test_gemm_backend_switch(monkeypatch: pytest.MonkeyPatch):
    weight = torch.randn(8, 4)
    monkeypatch.setenv("CONVEYOR_GEMM", "torch")
    assert not Gemm(weight).packed
    monkeypatch.setenv("CONVEYOR_GEMM", "bogus")
    with pytest.raises(ValueError, match="CONVEYOR_GEMM"):
        Gemm(weight)
    monkeypatch.setenv("CONVEYOR_GEMM", "onednn")
    with pytest.raises(ValueError, match="cannot pack"):
        Gemm(weight.to(torch.float16))


def test_the_kv_pool_on_cpu_sees_a_containers_memory_limit(tmp_path) -> None:
    """/proc/meminfo shows the host's memory inside a container; the cgroup limit is what the pod may take."""
    from conveyor.shard.runtime.host_memory import available_ram

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    host = 8000000 * 1024
    assert available_ram(tmp_path / "no-cgroup", meminfo) == host
    (tmp_path / "memory.max").write_text("1073741824\n")  # cgroup v2: a 1 GiB limit, 256 MiB used
    (tmp_path / "memory.current").write_text(str(256 << 20))
    assert available_ram(tmp_path, meminfo) == 768 << 20
    (tmp_path / "memory.max").write_text("max\n")  # no limit
    assert available_ram(tmp_path, meminfo) == host
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(512 << 20))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(128 << 20))
    assert available_ram(v1, meminfo) == 384 << 20


@pytest.mark.parametrize(
    "checkpoint, device, bf16_native, expected",
    [
        (None, "cpu", True, "float32"),  # a checkpoint that names no dtype
        ("float32", "cpu", True, "float32"),
        ("bfloat16", "cpu", True, "bfloat16"),
        ("bfloat16", "cpu", False, "float32"),
        ("float16", "cpu", False, "float32"),
        ("bfloat16", "cuda", True, "bfloat16"),
        ("bfloat16", "cuda", False, "float16"),  # a GPU without bf16
        ("float16", "cuda", True, "float16"),
        ("float32", "cuda", True, "float32"),
    ],
)
def test_dtype_auto_per_device_and_checkpoint(checkpoint, device: str, bf16_native: bool, expected: str):
    from conveyor.shard.runtime.device import choose_dtype

    assert choose_dtype("auto", checkpoint, torch.device(device), bf16_native) == expected
    assert choose_dtype("float16", checkpoint, torch.device(device), bf16_native) == "float16"
    with pytest.raises(ValueError, match="--dtype"):
        choose_dtype("fp8", checkpoint, torch.device(device), bf16_native)


def test_checkpoint_dtype_reads_either_config_name():
    from types import SimpleNamespace

    from conveyor.shard.runtime.device import checkpoint_dtype

    assert checkpoint_dtype(SimpleNamespace(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(SimpleNamespace(dtype=None, torch_dtype="float16")) == "float16"
    assert checkpoint_dtype(SimpleNamespace()) is None
