"""Compiles Conveyor's C++ kernels into one shared library per CPU kind, when the package is built.

`pip install .` (setup.py), the image and `make venv` run this once: each kind in `conveyor.cpu.KINDS` gets its
library in `built/` beside this file, with a manifest that says which torch, which sources and which compiler made
them, and a shard loads the one its CPU runs (library.py), with no compiler at run time. The libraries are built
from kernels.cpp, one translation unit that includes every kernel: torch's headers, most of a kernel's compile
time, are read once per kind rather than once per kernel and kind.

This module imports nothing of Conveyor's, so that setup.py can load it from the source tree before the package is
installed; what it needs of the CPU kinds comes in as arguments. Every library is written to a temporary name and
renamed into place, so a build killed at any instant leaves nothing a later build or load would take for finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILT = HERE / "built"  # where the package's own libraries live (package data)
UNIT = "kernels.cpp"
MANIFEST = "manifest.json"
COMMON_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp"]


class CompilerMissing(RuntimeError):
    pass


def sources_digest(folder: Path = HERE) -> str:
    """What the libraries are built from: every .cpp and .h beside this file, by name and content."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.cpp")) + sorted(folder.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def torch_release(version: str) -> str:
    """torch's version without its local build tag: a CPU and a CUDA build of one release share the C++ ABI that
    CPU kernels link against."""
    return version.split("+", 1)[0]


def compiler() -> str:
    """The C++ compiler: $CXX, as torch's cpp_extension reads it, else c++ on PATH."""
    chosen = os.environ.get("CXX", "c++")
    found = shutil.which(chosen)
    if found is None:
        raise CompilerMissing(f"no C++ compiler ({chosen!r} is not on PATH)")
    return found


def compiler_identity(cxx: str) -> str:
    """The compiler's first line of --version: part of a cached build's identity."""
    run = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return run.stdout.splitlines()[0].strip() if run.stdout else cxx


def command(cxx: str, isa_flags: list[str], out: Path, source_dir: Path = HERE) -> list[str]:
    """One compiler call that turns kernels.cpp into a library for one CPU kind, against the torch imported here."""
    import torch

    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx,
        *COMMON_FLAGS,
        *isa_flags,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem",
        str(torch_dir / "include"),
        str(source_dir / UNIT),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        "-o",
        str(out),
    ]


def compile_library(cxx: str, isa_flags: list[str], out: Path, source_dir: Path = HERE) -> None:
    """Builds one library at `out`, through a temporary name beside it: `out` is whole or absent."""
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        run = subprocess.run(command(cxx, isa_flags, partial, source_dir), capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{cxx} failed for {out.name}:\n{run.stderr[-4000:]}")
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def build_all(dest: Path, kinds: dict[str, list[str]], jobs: int | None = None, source_dir: Path = HERE) -> dict:
    """A library per kind (name -> its compiler switches) in `dest`, compiled side by side, and the manifest,
    written last: a folder whose manifest names a library holds that library whole."""
    import torch

    cxx = compiler()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).unlink(missing_ok=True)  # what is about to be replaced is no longer described
    jobs = jobs or min(len(kinds), os.cpu_count() or 1)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = [
            pool.submit(compile_library, cxx, flags, dest / f"{name}.so", source_dir) for name, flags in kinds.items()
        ]
        for future in done:
            future.result()
    manifest = {
        "torch": torch_release(torch.__version__),
        "sources": sources_digest(source_dir),
        "compiler": compiler_identity(cxx),
        "variants": {name: {"file": f"{name}.so", "flags": flags} for name, flags in kinds.items()},
        "seconds": round(time.monotonic() - start, 1),
    }
    partial = dest / f".{MANIFEST}.{os.getpid()}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, dest / MANIFEST)
    return manifest


def _kinds() -> dict[str, list[str]]:
    from conveyor import cpu

    return {name: cpu.compile_flags(name) for name in cpu.KINDS}


def main(argv: list[str] | None = None) -> None:
    """`python -m conveyor.shard.kernels.toolchain`: rebuilds the package's libraries in place (after editing a
    kernel in a checkout; setup.py does the same when the package is built)."""
    parser = argparse.ArgumentParser(description="Build the C++ kernels for every CPU kind into one folder.")
    parser.add_argument("--dest", type=Path, default=BUILT)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    print(f"building the C++ kernels for {', '.join(_kinds())} into {args.dest}", file=sys.stderr, flush=True)
    manifest = build_all(args.dest, _kinds(), args.jobs)
    print(f"built in {manifest['seconds']} s with {manifest['compiler']}", file=sys.stderr)


if __name__ == "__main__":
    main()
