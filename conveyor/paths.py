"""Where Conveyor keeps what it builds on a machine (the demo models, a fallback build of the C++ kernels, the
benchmark's models, the router's note of each checkpoint's tokenizer class), and how it builds there so that
nothing a killed process leaves can block a later start.

One root for every process, set by CONVEYOR_CACHE so that tests and CI can point all of them at one place. What is
built at run time is built once per machine by `build_once`: into a staging folder, renamed into place when whole,
under a lock the kernel drops when its holder dies (flock), so that several processes starting at once build it
once, and one killed at any instant (Ctrl-C, `docker stop`, an evicted pod, the OOM killer) leaves a stale staging
folder, removed by the next builder, and never a lock that blocks or a half-built folder taken for finished.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_REPORT_S = 10.0  # while waiting on another builder, say so at once and again this often


def cache_root() -> Path:
    """CONVEYOR_CACHE, or ~/.cache/conveyor."""
    return Path(os.environ.get("CONVEYOR_CACHE", Path.home() / ".cache" / "conveyor"))


def build_once(
    target: Path, build: Callable[[Path], None], what: str, finished: Callable[[Path], bool] = Path.is_dir
) -> Path:
    """`target`, made by `build(staging)` unless it is `finished` already. A `target` there but not finished (left
    by a build that wrote in place, before this) is built anew."""
    if finished(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with held(target.parent / f".{target.name}.lock", what):
        if finished(target):
            return target  # another process built it while this one waited
        for stale in target.parent.glob(f".{target.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)  # its builder died: the lock was free
        if target.exists():
            shutil.rmtree(target)
        staging = target.parent / f".{target.name}.staging-{os.getpid()}"
        staging.mkdir()
        build(staging)
        os.rename(staging, target)
    return target


@contextmanager
def held(lock: Path, what: str) -> Iterator[None]:
    """An exclusive flock on `lock` for the block. While another process holds it, says at once and every
    WAIT_REPORT_S who holds it and since when; the holder writes that into the file when it takes it."""
    with open(lock, "a+") as file:
        start = time.monotonic()
        reported: float | None = None
        while not _try_lock(file):
            now = time.monotonic()
            if reported is None or now - reported >= WAIT_REPORT_S:
                reported = now
                log.warning(
                    f"waiting for another process building {what}",
                    extra={"lock": str(lock), "holder": _holder(file), "waited_s": round(now - start, 1)},
                )
            time.sleep(0.2)
        if reported is not None:
            log.warning(f"took the lock for {what}", extra={"waited_s": round(time.monotonic() - start, 1)})
        file.seek(0)
        file.truncate()
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}))
        file.flush()
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _try_lock(file) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(file) -> str:
    file.seek(0)
    return file.read().strip() or "?"
