"""Builds and loads Conveyor's C++ kernels with torch's `cpp_extension`, once per machine, and says when not.

The kernels are compiled for the CPU they run on (`-march=native`), so the build folder is named for the torch
version and the CPU (model and flags): an image or cache folder moved to another CPU kind builds anew there
instead of running instructions that CPU lacks. Concurrent builds (several shards starting at once) wait on
cpp_extension's lock in that folder. Where nothing can be built (no compiler, no headers) every caller keeps its
torch path, which stays the reference.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from conveyor import cpu
from conveyor.paths import cache_root

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",
        "small_gemm.cpp",
        "int8_gemm.cpp",
        "int8_vnni_gemm.cpp",
        "int4_gemm.cpp",
        "int4_vnni_gemm.cpp",
        "rms_norm.cpp",
        "silu_mul.cpp",
        "rotary.cpp",
        "greedy.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("float_types.h", "row_dots.h", "row_dots_avx512.h", "attention_simd.h", "quantized_rows.h")
]  # part of the build's identity, not compiled on their own
BACKENDS = ("auto", "kernel", "torch")


class KernelUnavailable(RuntimeError):
    pass


def backend() -> str:
    """`CONVEYOR_ATTENTION`: auto (the kernels where they build), kernel (insist), or torch (the reference path for
    the decode attention and the norms)."""
    chosen = os.environ.get("CONVEYOR_ATTENTION", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"CONVEYOR_ATTENTION must be one of {BACKENDS}, not {chosen!r}")
    return chosen


def serves(device: torch.device) -> bool:
    """Whether the kernels that stand in for torch's eager ops in the forward (decode attention, RMSNorm) run on
    `device`: CPU, where they build and CONVEYOR_ATTENTION does not say torch."""
    return device.type == "cpu" and backend() != "torch" and load()


def build_folder() -> Path:
    """Where this machine's build lives: CONVEYOR_CACHE (as the demo model) / kernels / torch version and CPU."""
    found = cpu.probe()
    key = "\n".join([torch.__version__, found.model, *sorted(found.flags), *(s.read_text() for s in SOURCES + HEADERS)])
    return cache_root() / "kernels" / hashlib.sha256(key.encode()).hexdigest()[:16]


@functools.cache
def load() -> bool:
    """Builds (first use on this machine) and loads the kernels into `torch.ops.conveyor`; False where that fails,
    or raises where CONVEYOR_ATTENTION=kernel insists. Each caller has its own switch (CONVEYOR_ATTENTION for the
    decode attention, CONVEYOR_GEMM for the small-rows GEMM) and asks only when it is on."""
    chosen = backend()
    if _loaded():
        return True  # a library registers its ops once per process: never load a second build of it
    try:
        _build()
        return True
    except Exception as exc:  # noqa: BLE001 - any build failure means the torch path, said once
        if chosen == "kernel":
            raise KernelUnavailable(f"CONVEYOR_ATTENTION=kernel, but the kernels did not build: {exc}") from exc
        log.warning("kernels unavailable: the torch attention path serves", extra={"reason": str(exc)[:500]})
        return False


def _loaded() -> bool:
    return hasattr(torch.ops.conveyor, "paged_decode_attention")


def _build() -> None:
    from torch.utils import cpp_extension

    folder = build_folder()
    folder.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if not any(folder.glob("*.so")):
        log.warning("building the C++ kernels (first use on this machine)", extra={"folder": str(folder)})
    cpp_extension.load(
        name="conveyor_kernels",
        sources=[str(s) for s in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )
    log.info("kernels loaded", extra={"folder": str(folder), "seconds": round(time.monotonic() - start, 1)})


def main() -> None:
    """`python -m conveyor.shard.kernels.build`: builds now (the Makefile and the image do, so no shard waits)."""
    logging.basicConfig(level=logging.INFO)
    if not load():
        raise SystemExit("the kernels did not build; shards will serve with the torch attention path")
    print(f"kernels built in {build_folder()}")


if __name__ == "__main__":
    main()
