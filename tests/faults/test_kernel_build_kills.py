"""A kernel build killed at any point never blocks a later start: the lock dies with its holder, and what the
dead build left (a staging folder, an orphaned compiler still writing into it) is never taken for a library.

Shards load the libraries built with the package and build nothing; a shard builds its kind only where those do not
fit (another torch, an edited kernel), which is what each process here is made to do (CONVEYOR_KERNEL_LIBS names an
empty folder). Each is killed where the issue saw starts hang: holding the lock, and with the compiler running, by
SIGTERM and SIGKILL to its process group (Ctrl-C, `docker stop`, an evicted pod) and SIGKILL to the Python process
alone (the OOM killer). The start after them builds at once, without waiting on any of them, and serves the kernels.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from conveyor import cpu
from conveyor.shard.kernels import library as kernels

VARIANT = "avx2"  # every CPU that runs the kernels runs this one
START = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from conveyor.shard.kernels import library
assert library.load()
import torch
assert torch.ops.conveyor.greedy(torch.tensor([[0.0, 2.0, 1.0]]))[0].item() == 1
print(library.library())
"""


def start(cache: Path, libs: Path) -> subprocess.Popen:
    env = {**os.environ, "CONVEYOR_CACHE": str(cache), kernels.LIBS_SWITCH: str(libs), cpu.VARIANT_SWITCH: VARIANT}
    return subprocess.Popen(
        [sys.executable, "-c", START],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a launcher's shard or a container's processes
    )


def lock_held(process: subprocess.Popen, cache: Path) -> bool:
    """The builder wrote itself into the lock file: it holds the lock."""
    return any(lock.read_text().startswith("{") for lock in (cache / "kernels").glob(".*.lock"))


def compiling(process: subprocess.Popen, cache: Path) -> bool:
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    return any(child.name() == "cc1plus" for child in children)


def kill_group(process: subprocess.Popen, sig: int) -> None:
    os.killpg(process.pid, sig)
    process.communicate(timeout=60)


def kill_parent(process: subprocess.Popen, sig: int) -> None:
    process.send_signal(sig)
    process.communicate(timeout=60)


KILLS = [
    ("holding the lock", lock_held, lambda p: kill_group(p, signal.SIGTERM)),
    ("compiling", compiling, lambda p: kill_group(p, signal.SIGTERM)),
    ("compiling", compiling, lambda p: kill_group(p, signal.SIGKILL)),
    ("compiling", compiling, lambda p: kill_parent(p, signal.SIGKILL)),  # the compiler lives on, orphaned
]


@pytest.mark.skipif(cpu.probe().kind is None, reason="this CPU runs no kernel variant")
def test_a_start_after_builds_killed_at_each_point_builds_at_once_and_serves(tmp_path: Path) -> None:
    cache, libs = tmp_path / "cache", tmp_path / "no-shipped-libraries"
    libs.mkdir()
    for moment, reached, kill in KILLS:
        process = start(cache, libs)
        wait_for(lambda: reached(process, cache), 120, f"a build {moment}")  # noqa: B023 - called within the loop
        kill(process)
        assert process.returncode != 0, f"the build killed while {moment} finished anyway"
        assert not list((cache / "kernels").glob(f"{VARIANT}-*/*.so")), "a killed build left a library in place"
    process = start(cache, libs)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert "waiting for another process" not in err, err  # no killed build held it up
    library = Path(out.strip())
    assert library.name == f"{VARIANT}.so" and library.parent.parent == cache / "kernels"
    assert [p.name for p in (cache / "kernels").iterdir() if p.name.startswith(f".{library.parent.name}.staging")] == []
    holder = json.loads((cache / "kernels" / f".{library.parent.name}.lock").read_text())
    assert holder["pid"] == process.pid
