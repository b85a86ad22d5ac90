"""The one thread that runs all of a shard's torch work: loading, warmup and every step.

torch's CPU kernels run on OpenMP (libgomp), which gives each thread that enters a parallel region a team of
worker threads of its own. Once a process holds more OpenMP threads than the machine has cores, libgomp stops
spinning between regions (its throttled spin count) and every region of every team pays a futex wake-up. The
shard used to load the model on one thread and step on another: two teams, and every forward markedly slower than
the same forward run where the model was loaded (on the small demo model, float32, 2-core Intel Xeon, at batch 1
and batch 32 alike: the bare forward's decode step, benchmarks/bare.py, timed with the model loaded on another
thread against the same thread, measures it). One thread for everything keeps one team.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.ident: int = self.executor.submit(threading.get_ident).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the torch thread, awaited without blocking the event loop (torch releases the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)
