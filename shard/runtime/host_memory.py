"""How much memory the weights take and how much is left for the KV pool: the GPU's free memory, or on CPU the
host's available memory within any container limit, split between the ranks on the machine."""

from __future__ import annotations

import os
from pathlib import Path

import torch

CPU_MEMORY_FRACTION = 0.3  # of the memory available after loading, for the KV pool on CPU
GPU_MEMORY_FRACTION = 0.9


def model_bytes(model: torch.nn.Module) -> int:
    """What the model's weights take in memory: every tensor its modules hold and every holder that says its own
    size (a layer's GEMM, both copies where it keeps two; a quantized table), each once; the KV pool not
    included."""
    held = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor) or _sized(v)}
    return sum(v.nbytes for v in held.values())


def _sized(value: object) -> bool:
    return hasattr(type(value), "nbytes")


def free_memory(device: torch.device) -> float:
    """Bytes the KV pool may take: a share of what is free now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * GPU_MEMORY_FRACTION
    return available(device) * CPU_MEMORY_FRACTION


def available(device: torch.device) -> float:
    """This rank's part of the memory free now: the GPU's, or the machine's split between the ranks on it."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    ranks_here = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    return available_ram() / max(1, int(ranks_here))


def available_ram(cgroup: Path = Path("/sys/fs/cgroup"), meminfo: Path = Path("/proc/meminfo")) -> float:
    """What this process may still take: the host's available memory, or less when a container's cgroup limit
    leaves less (/proc/meminfo shows the host's memory inside a container, not the limit)."""
    available = 4 << 30
    with open(meminfo) as lines:
        for line in lines:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap = (cgroup / limit).read_text().strip()
            used = int((cgroup / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit():
            return max(0, min(available, int(cap) - used))
    return available
