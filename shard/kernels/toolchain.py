"""Compiles Conveyor's C++ kernels into one shared library per CPU kind, when the package is built.

`pip install .` (setup.py), the image and `make venv` run this once: each kind in `conveyor.cpu.KINDS` gets its
library in `built/` beside this file, with a manifest that says which torch, which sources and which compiler made
them, and a shard loads the one its CPU runs (library.py), with no compiler at run time. The libraries are built
from kernels.cpp, one translation unit that includes every kernel: torch's headers, most of a kernel's compile
time, are read once per kind rather than once per kernel and kind.

This module imports nothing of Conveyor's, so that setup.py can load it from the source tree before the package is
installed; what it needs of the CPU kinds comes in as arguments. Every library is written to a temporary name and
renamed into place, so a build killed at any instant leaves nothing a later build or load would take for finished.

A library is also kept in the machine's cache of builds (CONVEYOR_CACHE/kernels/<kind>-<build_key>/, where a shard
builds what no shipped library fits: library.py), and a build finds it there rather than compiling it again: `make
venv` then `make test` install the package twice, and reinstalling the same release (`pip install .` beside a
checkout, an upgrade that changed no kernel) would otherwise spend minutes compiling what the machine already has.
The key holds everything that makes the library (torch, flags, sources, compiler), so a hit is the same build.
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


def build_key(kind: str, flags: list[str], digest: str, compiler: str, torch_version: str) -> str:
    """Everything that makes a build and nothing else (not where the sources lie): two installs share a build
    exactly when they would build the same library."""
    identity = [torch_version, kind, *flags, digest, compiler]
    return hashlib.sha256("\n".join(identity).encode()).hexdigest()[:16]


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


def build_all(
    dest: Path,
    kinds: dict[str, list[str]],
    jobs: int | None = None,
    source_dir: Path = HERE,
    cache: Path | None = None,
) -> dict:
    """A library per kind (name -> its compiler switches) in `dest`, compiled side by side, and the manifest,
    written last: a folder whose manifest names a library holds that library whole. With a `cache` (a machine's
    CONVEYOR_CACHE/kernels), a kind built there already is copied rather than compiled, and one compiled here is
    left there too."""
    import torch

    cxx = compiler()
    identity = compiler_identity(cxx)
    digest = sources_digest(source_dir)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MANIFEST).unlink(missing_ok=True)  # what is about to be replaced is no longer described
    jobs = jobs or min(len(kinds), os.cpu_count() or 1)
    start = time.monotonic()

    def one(name: str, flags: list[str]) -> bool:
        key = build_key(name, flags, digest, identity, torch.__version__)
        kept = None if cache is None else cache / f"{name}-{key}"
        return build_or_reuse(cxx, flags, dest / f"{name}.so", source_dir, kept)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = {name: pool.submit(one, name, flags) for name, flags in kinds.items()}
        reused = [name for name, future in done.items() if future.result()]
    manifest = {
        "torch": torch_release(torch.__version__),
        "sources": digest,
        "compiler": identity,
        "variants": {name: {"file": f"{name}.so", "flags": flags} for name, flags in kinds.items()},
        "seconds": round(time.monotonic() - start, 1),
        "reused": reused,
    }
    partial = dest / f".{MANIFEST}.{os.getpid()}.partial"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, dest / MANIFEST)
    return manifest


def build_or_reuse(cxx: str, flags: list[str], out: Path, source_dir: Path, kept: Path | None) -> bool:
    """`out` built, or copied from `kept` (the cache's folder for this exact build) where it holds the library;
    a library compiled here is left in `kept` as a whole folder, renamed into place as library.py's builds are.
    True where it was copied."""
    library = None if kept is None else kept / out.name
    if library is not None and library.is_file():
        partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
        shutil.copyfile(library, partial)
        os.replace(partial, out)
        return True
    compile_library(cxx, flags, out, source_dir)
    if kept is not None:
        _keep(out, kept)
    return False


def _keep(library: Path, kept: Path) -> None:
    """A copy of `library` in `kept`, unless another build put one there first; a cache that cannot be written
    costs only the next build's time."""
    staging = kept.parent / f".{kept.name}.staging-{os.getpid()}-{library.stem}"
    try:
        staging.mkdir(parents=True)
        shutil.copyfile(library, staging / library.name)
        os.rename(staging, kept)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def _kinds() -> dict[str, list[str]]:
    from conveyor import cpu

    return {name: cpu.compile_flags(name) for name in cpu.KINDS}


def main(argv: list[str] | None = None) -> None:
    """`python -m conveyor.shard.kernels.toolchain`: rebuilds the package's libraries in place (after editing a
    kernel in a checkout; setup.py does the same when the package is built)."""
    parser = argparse.ArgumentParser(description="Build the C++ kernels for every CPU kind into one folder.")
    parser.add_argument("--dest", type=Path, default=BUILT)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--no-cache", action="store_true", help="compile every kind, whatever the cache holds")
    args = parser.parse_args(argv)
    from conveyor.paths import cache_root

    cache = None if args.no_cache else cache_root() / "kernels"
    print(f"building the C++ kernels for {', '.join(_kinds())} into {args.dest}", file=sys.stderr, flush=True)
    manifest = build_all(args.dest, _kinds(), args.jobs, cache=cache)
    print(f"built in {manifest['seconds']} s with {manifest['compiler']}{reuse_note(manifest)}", file=sys.stderr)


def reuse_note(manifest: dict) -> str:
    """What a build's report adds where it copied kinds from the cache rather than compiling them."""
    reused = manifest.get("reused") or []
    return f" ({', '.join(reused)} from the cache of builds)" if reused else ""


if __name__ == "__main__":
    main()
