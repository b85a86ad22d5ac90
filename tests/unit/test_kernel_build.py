"""The kernels as a shard gets them: the library shipped for its CPU kind, loaded with no compiler; a build of its
own only where the shipped ones do not fit, keyed by what makes it; the torch path where nothing loads. A killed
build is tests/faults/test_kernel_build_kills.py's; `pip install .` serving is tests/e2e/test_install.py's."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import wait_for

from conveyor import cpu, paths
from conveyor.shard.kernels import library as kernels
from conveyor.shard.kernels import toolchain
from conveyor.shard.layers.attention import AttentionGroup, AttentionMetadata, decode_kernel
from conveyor.shard.layers.gemm import Gemm
from conveyor.shard.layers.norm import RMSNorm

# Loads the library this process would, checks three kernels against torch, prints the library's path.
CHECK = """
import torch, torch.nn.functional as F
from conveyor.shard.kernels import library
assert library.load()
x, w = torch.randn(3, 100), torch.randn(50, 100)
torch.testing.assert_close(torch.ops.conveyor.small_gemm(x[:2], w, None), F.linear(x[:2], w))
norm = torch.ops.conveyor.rms_norm(x, w[0], 1e-6, False)
torch.testing.assert_close(norm, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[0])
ids, _ = torch.ops.conveyor.greedy(x)
assert torch.equal(ids, x.argmax(-1)), ids
print(library.library())
"""


def run_check(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK], env={**os.environ, **env}, capture_output=True, text=True)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`load` asked anew, with no shipped library that fits and an empty cache folder, as in a process that has
    not loaded the kernels."""
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "none").mkdir()
    monkeypatch.setenv(kernels.LIBS_SWITCH, str(tmp_path / "none"))
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    kernels.load.cache_clear()
    yield
    kernels.load.cache_clear()


# --- what ships ----------------------------------------------------------------------------------------------------


def test_every_cpu_kind_is_built_with_the_package() -> None:
    """All four compile on any x86 machine, whichever this CPU runs, against this torch and these sources."""
    manifest = json.loads((toolchain.BUILT / toolchain.MANIFEST).read_text())
    assert list(manifest["variants"]) == list(cpu.KINDS)
    for kind, built in manifest["variants"].items():
        assert (toolchain.BUILT / built["file"]).stat().st_size > 0
        assert built["flags"] == cpu.compile_flags(kind)
    assert manifest["torch"] == toolchain.torch_release(torch.__version__)
    assert manifest["sources"] == toolchain.sources_digest()
    assert kernels.why_unfit(toolchain.BUILT, cpu.probe().kind) is None


def test_the_shipped_library_loads_with_no_compiler_and_writes_nothing(tmp_path: Path) -> None:
    no_compiler = {"PATH": str(Path(sys.executable).parent), "CXX": "/nonexistent/c++"}
    run = run_check({**no_compiler, "CONVEYOR_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == toolchain.BUILT / f"{cpu.probe().kind}.so"
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("kind", list(cpu.KINDS))
def test_each_variant_this_cpu_runs_computes_as_torch_does(tmp_path: Path, kind: str) -> None:
    """The kernel and layer tests run under this CPU's own variant and, in `make test`, under avx2; here each one
    in between loads and computes too. A variant above this CPU is only compiled (the test above)."""
    if not cpu.KINDS[kind] <= cpu.probe().flags:
        pytest.skip(f"this CPU does not run {kind}")
    run = run_check({cpu.VARIANT_SWITCH: kind, "CONVEYOR_CACHE": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).name == f"{kind}.so"


# --- when the shipped libraries do not fit --------------------------------------------------------------------------


def _shipped(folder: Path, **changes) -> Path:
    folder.mkdir()
    manifest = json.loads((toolchain.BUILT / toolchain.MANIFEST).read_text())
    (folder / toolchain.MANIFEST).write_text(json.dumps({**manifest, **changes}))
    for built in manifest["variants"].values():
        (folder / built["file"]).write_bytes(b"")
    return folder


def test_why_shipped_libraries_do_not_fit(tmp_path: Path) -> None:
    assert kernels.why_unfit(_shipped(tmp_path / "ok"), "avx2") is None
    assert "holds no finished build" in kernels.why_unfit(tmp_path / "absent", "avx2")
    assert "built against torch 2.4.0, running" in kernels.why_unfit(_shipped(tmp_path / "t", torch="2.4.0"), "avx2")
    assert "built from other sources" in kernels.why_unfit(_shipped(tmp_path / "s", sources="0" * 16), "avx2")
    assert "no avx2 library" in kernels.why_unfit(_shipped(tmp_path / "v", variants={}), "avx2")


def test_a_build_is_keyed_by_what_makes_it_not_by_where_it_lies(tmp_path: Path) -> None:
    """Two installs of one version (a clone beside a venv's copy) share a build; another torch, compiler or kind
    gets its own."""
    elsewhere = tmp_path / "kernels"
    shutil.copytree(toolchain.HERE, elsewhere, ignore=shutil.ignore_patterns("built", "__pycache__"))
    assert toolchain.sources_digest(elsewhere) == toolchain.sources_digest()
    key = kernels.build_key("avx2", "g++ 12")
    assert kernels.build_key("avx2", "g++ 12") == key
    assert len({key, kernels.build_key("avx512", "g++ 12"), kernels.build_key("avx2", "g++ 13")}) == 3
    assert kernels.build_key("avx2", "g++ 12", torch_version="2.4.0") != key


# Stands in for the C++ compiler where only the build's bookkeeping is under test: writes the -o file, and counts.
FAKE_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake c++ 1.0"; exit 0; fi
echo compiled >> "$(dirname "$0")/calls"
while [ $# -gt 1 ]; do if [ "$1" = "-o" ]; then echo "library $*" > "$2"; fi; shift; done
"""


def test_a_package_build_reuses_the_machines_builds_and_files_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make venv` then `make test` build the package twice, and a reinstall of the same release builds it again:
    a kind whose exact build (same key) the machine's cache holds is copied, where a shard's own build would also
    find it; what is compiled is filed there for the next."""
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    calls = tmp_path / "bin" / "calls"
    compiled = lambda: len(calls.read_text().splitlines()) if calls.exists() else 0  # noqa: E731
    kinds, cache = {"avx2": cpu.compile_flags("avx2"), "avx512": cpu.compile_flags("avx512")}, tmp_path / "kernels"
    first = toolchain.build_all(tmp_path / "one", kinds, cache=cache)
    assert compiled() == 2 and first["reused"] == []
    key = kernels.build_key("avx2", "fake c++ 1.0")  # the key a shard's own build of this kind would look under
    assert (cache / f"avx2-{key}" / "avx2.so").read_bytes() == (tmp_path / "one" / "avx2.so").read_bytes()
    second = toolchain.build_all(tmp_path / "two", kinds, cache=cache)
    assert compiled() == 2 and second["reused"] == ["avx2", "avx512"]
    assert (tmp_path / "two" / "avx512.so").read_bytes() == (tmp_path / "one" / "avx512.so").read_bytes()
    assert kernels.why_unfit(tmp_path / "two", "avx2") is None
    other = {"avx2": [*kinds["avx2"], "-DOTHER"]}  # another build of the kind: compiled, not taken from the cache
    assert toolchain.build_all(tmp_path / "three", other, cache=cache)["reused"] == [] and compiled() == 3
    toolchain.build_all(tmp_path / "four", kinds)  # no cache named: everything compiled
    assert compiled() == 5
    assert not list(cache.glob(".*staging*"))


def test_no_compiler_means_the_torch_path(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # what toolchain.py compiles with
    monkeypatch.delenv("CONVEYOR_ATTENTION", raising=False)
    assert kernels.load() is False
    assert decode_kernel(torch.device("cpu")) is False
    meta = AttentionMetadata.build([[1]], [3], [1], 16, torch.device("cpu"))
    assert isinstance(meta.groups[0], AttentionGroup)
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)
    assert Gemm(torch.randn(8, 4)).plain is None  # one or two rows take oneDNN too
    assert RMSNorm(torch.ones(8), 1e-6).kernel is False


def test_a_cpu_below_avx2_keeps_the_torch_path(fresh, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    below = cpu.Cpu("old", 2, frozenset({"sse4_2", "avx"}), False)
    monkeypatch.setattr(cpu, "probe", lambda: below)
    monkeypatch.delenv("CONVEYOR_ATTENTION", raising=False)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.load() is False
    assert "lacks avx2, f16c, fma" in caplog.records[-1].reason


def test_insisting_on_the_kernel_fails_where_it_cannot_load(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("CONVEYOR_ATTENTION", "kernel")
    with pytest.raises(kernels.KernelUnavailable, match="no C\\+\\+ compiler"):
        kernels.load()


def test_the_switch_turns_the_kernel_off_without_loading(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_ATTENTION", "torch")
    monkeypatch.setattr(kernels, "library", lambda: pytest.fail("asked for a library although switched off"))
    assert decode_kernel(torch.device("cpu")) is False
    monkeypatch.setenv("CONVEYOR_ATTENTION", "fast")
    with pytest.raises(ValueError, match="CONVEYOR_ATTENTION"):
        kernels.load()


def test_gpu_rows_never_take_the_cpu_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "load", lambda: True)
    assert decode_kernel(torch.device("cuda", 0)) is False
    assert decode_kernel(torch.device("cpu")) is True


# --- building once, whole, under a lock that dies with its holder --------------------------------------------------


def test_a_build_left_half_done_is_built_anew(tmp_path: Path) -> None:
    """A staging folder of a dead builder is removed, and a target without its finished mark is replaced."""
    target = tmp_path / "thing"
    (tmp_path / ".thing.staging-99999").mkdir()
    target.mkdir()
    (target / "half").write_text("")

    def build(staging: Path) -> None:
        (staging / "done").write_text("whole")

    paths.build_once(target, build, "a thing", finished=lambda t: (t / "done").exists())
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]
    assert sorted(p.name for p in target.iterdir()) == ["done"]
    paths.build_once(target, lambda staging: pytest.fail("built twice"), "a thing")


def test_a_start_waiting_on_another_build_says_who_holds_it_and_since_when(tmp_path: Path, caplog) -> None:
    """The lock is another process's here in all but name: flock locks belong to the open file, not the process."""
    lock = tmp_path / ".thing.lock"
    holder_done = threading.Event()
    holding = threading.Event()

    def hold() -> None:
        with paths.held(lock, "a thing"):
            holding.set()
            holder_done.wait(60)

    threading.Thread(target=hold, daemon=True).start()
    assert holding.wait(60)
    built: list[Path] = []

    def build(staging: Path) -> None:
        built.append(staging)

    waiter = threading.Thread(target=paths.build_once, args=(tmp_path / "thing", build, "a thing"), daemon=True)
    with caplog.at_level(logging.WARNING, logger=paths.__name__):
        waiter.start()
        wait_for(lambda: any("waiting for another process" in r.getMessage() for r in caplog.records), 60, "a wait")
        record = next(r for r in caplog.records if "waiting for another process" in r.getMessage())
        holder = json.loads(record.holder)
        assert holder["pid"] == os.getpid() and holder["since"] and record.lock == str(lock)
        assert not built
        holder_done.set()
        waiter.join(60)
    assert len(built) == 1 and (tmp_path / "thing").is_dir()
