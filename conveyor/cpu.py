"""What this CPU offers, asked in one place, so that every choice that depends on it can be faked in a test.

Conveyor lands on AMD EPYCs (AVX2 with no bf16 kernels in oneDNN, or Zen 4 with AVX-512 and avx512_bf16) and on
Intel Xeons (AVX-512, avx512_bf16, VNNI, sometimes AMX). What differs between them: whether oneDNN runs bf16 matmuls
(the GEMM packs bf16 weights, the benchmark adds its bf16 systems by default), whether bf16 computes prompts faster
than float32 (the vendor and AMX decide), the instruction sets the benchmark records beside its numbers, and how
many cores a process may use. Everything that depends on them asks here and nowhere else: a test fakes a CPU
kind by replacing `torch_bf16` and `CPUINFO`, and `CONVEYOR_CPU_BF16=0` makes a CPU with bf16 kernels behave as
one without, so that both branches run on a Xeon.

The C++ kernels ship built for each x86 kind in `KINDS` (shard/kernels/toolchain.py), and a shard loads the last kind
whose flags this CPU has. `CONVEYOR_CPU_VARIANT=avx2` (or any kind at or below this CPU's) makes every choice here
see a CPU of that kind: the kernels' variant, and the flags `probe` reports, so that an AVX-512 machine runs the
AVX2 machine's branches (the Makefile's test target does, with oneDNN and ATen held to AVX2 as well).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

BF16_SWITCH = "CONVEYOR_CPU_BF16"
VARIANT_SWITCH = "CONVEYOR_CPU_VARIANT"
CPUINFO = Path("/proc/cpuinfo")

_AVX2 = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
# The x86 kinds the kernels are built for, least to most, each as the /proc/cpuinfo flags its instructions need:
# AVX2 + FMA (most desktops and AMD EPYCs before Zen 4), AVX-512 (Skylake-SP), + VNNI (Cascade Lake, Ice Lake),
# + BF16 (Cooper Lake, Sapphire Rapids and later, AMD Zen 4 and later). No kernel uses AMX tiles (oneDNN's
# matmuls do), so an AMX Xeon takes avx512_bf16. A CPU below AVX2 keeps the torch path.
KINDS: dict[str, frozenset[str]] = {
    "avx2": _AVX2,
    "avx512": _AVX512,
    "avx512_vnni": _AVX512 | {"avx512_vnni"},
    "avx512_bf16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
}
_GOVERNED = ("avx512", "amx", "avx_")  # flag prefixes a kind below them hides, beside every flag in KINDS


def kind_of(flags: frozenset[str]) -> str | None:
    """The most capable kind whose instructions `flags` all offer, or None below AVX2."""
    return next((name for name in reversed(KINDS) if KINDS[name] <= flags), None)


def compile_flags(kind: str) -> list[str]:
    """The compiler's switches for a kind's instructions: each cpuinfo flag is gcc's -m name without underscores."""
    return [f"-m{flag.replace('_', '')}" for flag in sorted(KINDS[kind])]


def runnable_kinds(flags: frozenset[str]) -> list[str]:
    """The kinds a CPU with `flags` runs, least capable first: its own and every one below it."""
    return [kind for kind, needs in KINDS.items() if needs <= flags]


def capped(flags: frozenset[str], switch: str | None = None) -> frozenset[str]:
    """`flags` as a CPU of the kind `CONVEYOR_CPU_VARIANT` names would show them: every instruction-set flag above
    that kind hidden. Naming a kind this CPU lacks is an error, not a quiet downgrade of the machine's own kind."""
    switch = os.environ.get(VARIANT_SWITCH, "") if switch is None else switch
    if not switch:
        return flags
    if switch not in KINDS:
        raise ValueError(f"{VARIANT_SWITCH} must be one of {', '.join(KINDS)} (or unset), not {switch!r}")
    if not KINDS[switch] <= flags:
        missing = ", ".join(sorted(KINDS[switch] - flags))
        raise ValueError(f"{VARIANT_SWITCH}={switch}, but this CPU lacks {missing}")
    kept = KINDS[switch]
    governed = set().union(*KINDS.values())
    return frozenset(f for f in flags if f in kept or not (f in governed or f.startswith(_GOVERNED)))


def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU. Elsewhere torch's bf16 matmul takes a scalar fallback,
    far slower than float32 (on such a CPU `make bench ARGS="--dtypes float32,bfloat16"` measures it, the bare
    forward in each dtype), so bf16 stays correct but is not worth choosing by default.

    `CONVEYOR_CPU_BF16=0` answers no on any CPU. `=1` insists on yes and fails where the CPU cannot, so that a job
    meant to cover the bf16 kernels cannot pass on a machine without them unnoticed."""
    switch = os.environ.get(BF16_SWITCH, "")
    if switch not in ("", "0", "1"):
        raise ValueError(f"{BF16_SWITCH} must be 0 or 1 (or unset: ask the CPU), not {switch!r}")
    if switch == "0":
        return False
    supported = torch_bf16()
    if switch == "1" and not supported:
        raise RuntimeError(f"{BF16_SWITCH}=1, but oneDNN has no bf16 kernels for this CPU")
    return supported


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (avx512_bf16 or AMX) and oneDNN runs it: where `--dtype auto`
    keeps a bf16 checkpoint in bf16. An AVX-512 CPU without those converts in oneDNN, which is correct but no
    faster than float32. `CONVEYOR_CPU_BF16=0` answers no here too."""
    if not onednn_bf16():
        return False
    found = probe()
    return found.avx512_bf16 or found.amx


def torch_bf16() -> bool:
    """torch's own check, the one its oneDNN calls obey: AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT on x86. It says
    yes on an AVX-512 Xeon without avx512_bf16 too, where oneDNN converts; `Cpu` tells those apart for the report."""
    import torch

    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def usable_cores() -> int:
    """The cores this process may run on: a container's cpuset, not the host's count that os.cpu_count() gives."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(local_ranks: int, cores: int, environ: Mapping[str, str] = os.environ) -> int | None:
    """torch threads for each of `local_ranks` shard ranks sharing this machine, or None to keep torch's own count:
    a rank alone has the cores to itself, and OMP_NUM_THREADS is the choice of someone who knows the pod's share
    (the Kubernetes manifests set it; a count from the node's cores would override a container's CPU limit)."""
    if local_ranks <= 1 or environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, cores // local_ranks)


@dataclass(frozen=True)
class Cpu:
    """The CPU as the benchmark records it: a forward's speed is mostly its matmul units."""

    model: str
    cores: int
    flags: frozenset[str]
    onednn_bf16: bool
    vendor: str = "?"  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        """bf16 dot products in AVX-512 (Cooper Lake and later Xeons, AMD Zen 4)."""
        return "avx512_bf16" in self.flags

    @property
    def vnni(self) -> bool:
        return bool({"avx512_vnni", "avx_vnni"} & self.flags)

    @property
    def kind(self) -> str | None:
        """The kernels' variant this CPU runs (`KINDS`), None below AVX2."""
        return kind_of(self.flags)

    @property
    def amd(self) -> bool:
        return self.vendor == "AuthenticAMD"

    @property
    def amx(self) -> bool:
        """Tile matrix units (Sapphire Rapids and later Xeons); oneDNN uses them for bf16 when they are there."""
        return "amx_bf16" in self.flags


def probe() -> Cpu:
    """This machine's CPU, from /proc/cpuinfo (empty elsewhere) and `onednn_bf16`, its flags `capped` by
    CONVEYOR_CPU_VARIANT."""
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        lines = []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    vendor = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "?")
    return Cpu(model, usable_cores(), capped(frozenset(flags)), onednn_bf16(), vendor)


def middle_kinds(flags: frozenset[str]) -> list[str]:
    """The kinds a CPU with `flags` runs above AVX2 and below its own: `make test` runs its kernel and quantization
    tests once more under each (an AMX Xeon: avx512 and avx512_vnni), as it does under AVX2, so that every library
    this CPU could load is held, not only the two at the ends."""
    return runnable_kinds(flags)[1:-1]


if __name__ == "__main__":  # `python -m conveyor.cpu`: the middle kinds, a line each (the Makefile reads them)
    print("\n".join(middle_kinds(probe().flags)))
