"""Which device a shard rank runs on, and the few things that differ by device.

The choice is one pure function of what was asked and what the machine has, so the CPU tests cover it; the rest
of the shard only ever asks `device.type`.
"""

from __future__ import annotations

import torch

from conveyor.config import DEVICES as CHOICES


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
