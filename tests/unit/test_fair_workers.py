"""The validation threads' fair turns (router/pipeline/fair_workers.py), with jobs the test releases one by one."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from conveyor.router.pipeline.fair_workers import FairWorkers


async def test_a_key_waits_behind_its_own_jobs_not_behind_another_keys_flood() -> None:
    started: list[str] = []
    gates = {name: threading.Event() for name in ("a1", "a2", "a3", "b1")}

    def job(name: str):
        def run() -> str:
            started.append(name)
            gates[name].wait(30)
            return name

        return run

    with ThreadPoolExecutor(1) as executor:
        workers = FairWorkers(executor, 1)
        flood = [asyncio.ensure_future(workers.run("a", job(n))) for n in ("a1", "a2", "a3")]
        await asyncio.sleep(0)
        other = asyncio.ensure_future(workers.run("b", job("b1")))
        await asyncio.sleep(0)
        for name in ("a1", "b1", "a2", "a3"):  # b's one job goes right after the job already running
            gates[name].set()
        assert await asyncio.gather(*flood, other) == ["a1", "a2", "a3", "b1"]
    assert started == ["a1", "b1", "a2", "a3"]


async def test_a_job_cancelled_while_it_waits_never_runs_and_errors_reach_the_caller() -> None:
    ran: list[str] = []
    gate = threading.Event()

    def blocking() -> None:
        gate.wait(30)

    def failing() -> None:
        ran.append("failing")
        raise ValueError("bad prompt")

    with ThreadPoolExecutor(1) as executor:
        workers = FairWorkers(executor, 1)
        first = asyncio.ensure_future(workers.run("a", blocking))
        waiting = asyncio.ensure_future(workers.run("a", lambda: ran.append("cancelled")))
        failed = asyncio.ensure_future(workers.run("b", failing))
        await asyncio.sleep(0)
        waiting.cancel()
        gate.set()
        await first
        try:
            await failed
        except ValueError as exc:
            assert str(exc) == "bad prompt"
        else:
            raise AssertionError("the job's error was lost")
        assert workers.free == 1 and workers.waiting() == 0
    assert ran == ["failing"]
