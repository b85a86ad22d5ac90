"""Which device a shard rank runs on, and the few things that differ by device.

The choice is one pure function of what was asked and what the machine has, so the CPU tests cover it; the rest
of the shard only ever asks `device.type`.
"""

from __future__ import annotations

import torch

from conveyor.config import DEVICES as CHOICES
from conveyor.config import DTYPES


class DeviceUnavailable(ValueError):
    pass


def choose_device(requested: str, rank: int, cuda_devices: int | None = None) -> torch.device:
    """`auto` takes a GPU when there is one, else the CPU. Rank r of a tensor-parallel group takes GPU
    r modulo the visible count (one rank per GPU, as the launcher starts them)."""
    if requested not in CHOICES:
        raise DeviceUnavailable(f"--device must be one of {CHOICES}, not {requested!r}")
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if requested == "cpu" or (requested == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        raise DeviceUnavailable("--device cuda, but no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver?)")
    return torch.device("cuda", rank % count)


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensors built per step go to a GPU from pinned memory without blocking the host; on CPU, as is."""
    if device.type != "cuda":
        return values
    return values.pin_memory().to(device, non_blocking=True)


def choose_dtype(requested: str, checkpoint: str | None, device: torch.device, bf16_native: bool) -> str:
    """The dtype a shard computes in. `auto` keeps the checkpoint's own dtype where the device computes it
    natively, as TGI and vLLM choose: bf16 on GPUs with bf16 (else float16) and on CPUs with avx512_bf16 or AMX
    (`bf16_native`); float16 on GPUs, and as bf16 on such CPUs; float32 otherwise, and for float32 checkpoints
    or checkpoints that name none. Any other choice is taken as asked."""
    if requested not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, not {requested!r}")
    if requested != "auto":
        return requested
    if checkpoint not in ("bfloat16", "float16"):
        return "float32"
    if device.type == "cuda":
        return checkpoint if checkpoint == "float16" or bf16_native else "float16"
    return "bfloat16" if bf16_native else "float32"


def checkpoint_dtype(config: object) -> str | None:
    """The dtype a Hugging Face config says its weights are in (`dtype`, or `torch_dtype` before transformers 5)."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if found is None:
        return None
    return str(found).removeprefix("torch.")


def device_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively (see `choose_dtype`)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from conveyor import cpu

    return cpu.native_bf16()
