"""Loads the C++ kernels built for this CPU's kind into `torch.ops.conveyor`, once per process, and says when not.

The package ships a library per x86 kind (`conveyor.cpu.KINDS`, built by toolchain.py when the package is), and a
shard loads the most capable one its CPU runs, as llama.cpp's CPU variants and oneDNN's dispatch choose: nothing
is compiled when a shard starts. `CONVEYOR_CPU_VARIANT` picks a kind at or below the CPU's (conveyor/cpu.py).

Only where the package's libraries do not fit this process (torch is another release than the one they were built
against, or a kernel's source was edited since) is the kind built here, once per machine, into CONVEYOR_CACHE
(`paths.build_once`: a killed build never blocks a later one), keyed by everything that makes the build, so that
two installs share a build only where it is the same build. A CPU below AVX2, or a fallback with no compiler,
keeps the torch path, which stays the reference, and says so once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

import torch

from conveyor import cpu
from conveyor.paths import build_once, cache_root
from conveyor.shard.kernels import toolchain

log = logging.getLogger(__name__)

BACKENDS = ("auto", "kernel", "torch")
LIBS_SWITCH = "CONVEYOR_KERNEL_LIBS"  # a folder of libraries and their manifest, in place of the package's own


class KernelUnavailable(RuntimeError):
    pass


def backend() -> str:
    """`CONVEYOR_ATTENTION`: auto (the kernels where they load), kernel (insist), or torch (the reference path for
    the decode attention and the norms)."""
    chosen = os.environ.get("CONVEYOR_ATTENTION", "auto")
    if chosen not in BACKENDS:
        raise ValueError(f"CONVEYOR_ATTENTION must be one of {BACKENDS}, not {chosen!r}")
    return chosen


def serves(device: torch.device) -> bool:
    """Whether the kernels that stand in for torch's eager ops in the forward (decode attention, RMSNorm) run on
    `device`: CPU, where they load and CONVEYOR_ATTENTION does not say torch."""
    return device.type == "cpu" and backend() != "torch" and load()


@functools.cache
def load() -> bool:
    """Loads this CPU kind's library; False where none can be had, or raises where CONVEYOR_ATTENTION=kernel
    insists. Each caller has its own switch (CONVEYOR_ATTENTION for the decode attention, CONVEYOR_GEMM for the
    small-rows GEMM) and asks only when it is on."""
    chosen = backend()
    if loaded():
        return True  # a library registers its ops once per process: never load a second one
    try:
        path = library()
        torch.ops.load_library(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure means the torch path, said once
        if chosen == "kernel":
            raise KernelUnavailable(f"CONVEYOR_ATTENTION=kernel, but the kernels did not load: {exc}") from exc
        log.warning("kernels unavailable: the torch path serves", extra={"reason": str(exc)[:500]})
        return False
    log.info("kernels loaded", extra={"variant": path.stem, "library": str(path)})
    return True


def loaded() -> bool:
    """Whether this process has a kernel library's ops registered already (torch registers them once)."""
    return hasattr(torch.ops.conveyor, "paged_decode_attention")


def library() -> Path:
    """The library this process loads: the package's own for this CPU's kind, else one built here for it."""
    kind = cpu.probe().kind
    if kind is None:
        raise KernelUnavailable(f"this CPU lacks {', '.join(sorted(cpu.KINDS['avx2']))}: no kernel variant runs here")
    folder = Path(os.environ.get(LIBS_SWITCH) or toolchain.BUILT)
    unfit = why_unfit(folder, kind)
    if unfit is None:
        return folder / f"{kind}.so"
    log.warning("no shipped kernels fit: building them for this machine", extra={"variant": kind, "reason": unfit})
    return built_here(kind)


def why_unfit(folder: Path, kind: str) -> str | None:
    """Why `folder`'s libraries cannot serve this process as `kind`, or None where its library for it can."""
    try:
        manifest = json.loads((folder / toolchain.MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{folder} holds no finished build (was the package built without a compiler?)"
    running = toolchain.torch_release(torch.__version__)
    if manifest.get("torch") != running:
        return f"built against torch {manifest.get('torch')}, running {running}"
    if manifest.get("sources") != toolchain.sources_digest():
        return "built from other sources (a kernel edited since: python -m conveyor.shard.kernels.toolchain)"
    if kind not in manifest.get("variants", {}) or not (folder / f"{kind}.so").is_file():
        return f"no {kind} library in {folder}"
    return None


def built_here(kind: str) -> Path:
    """This kind's library built on this machine, once, into CONVEYOR_CACHE/kernels/<kind>-<build_key>/."""
    cxx = toolchain.compiler()
    target = cache_root() / "kernels" / f"{kind}-{build_key(kind, toolchain.compiler_identity(cxx))}"

    def build(staging: Path) -> None:
        log.warning("building the C++ kernels for this machine", extra={"variant": kind, "folder": str(target)})
        toolchain.compile_library(cxx, cpu.compile_flags(kind), staging / f"{kind}.so")

    return build_once(target, build, f"the {kind} kernels") / f"{kind}.so"


def build_key(kind: str, compiler: str, torch_version: str = torch.__version__) -> str:
    """This kind's key among the machine's builds (toolchain.build_key), for the sources beside this file: the
    package builds (setup.py, `make`) file theirs under the same keys, so either finds the other's."""
    return toolchain.build_key(kind, cpu.compile_flags(kind), toolchain.sources_digest(), compiler, torch_version)
