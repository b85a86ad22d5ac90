"""The validation threads, shared fairly between API keys.

Tokenizing, rendering a chat template and compiling a grammar run on a few threads off the event loop. First come,
first served, one key sending large prompts filled every thread and everyone else's short request waited behind
them (an admin's short request waited for every other key's huge prompts to be tokenized). Here each key
has a queue of its own and a free thread takes the next job of the key whose last job started longest ago (or
never): a key's work waits behind its own, and behind at most one job of each other key.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")
Job = tuple[Callable[[], Any], asyncio.Future]


class FairWorkers:
    def __init__(self, executor: Executor, workers: int) -> None:
        self.executor = executor
        self.free = workers  # threads not running a job now
        self._queues: dict[str, deque[Job]] = {}  # by key: its jobs waiting, in order
        self._served: dict[str, int] = {}  # by key (API key names: a bounded set): when its last job started
        self._turns = itertools.count()

    async def run(self, owner: str, fn: Callable[[], T]) -> T:
        """`fn()` on a thread, in `owner`'s turn. Cancelled while it waits, it never runs."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(owner, deque()).append((fn, future))
        self._dispatch()
        return await future

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _dispatch(self) -> None:
        while self.free and (job := self._next()) is not None:
            fn, future = job
            self.free -= 1
            running = asyncio.get_running_loop().run_in_executor(self.executor, fn)
            running.add_done_callback(lambda done, future=future: self._finished(done, future))

    def _next(self) -> Job | None:
        """The first live job of the key whose last job started longest ago (or never)."""
        while self._queues:
            owner = min(self._queues, key=lambda o: self._served.get(o, -1))
            queue = self._queues[owner]
            fn, future = queue.popleft()
            self._served[owner] = next(self._turns)
            if not queue:
                del self._queues[owner]
            if not future.cancelled():  # its caller went away while it waited
                return fn, future
        return None

    def _finished(self, done: asyncio.Future, future: asyncio.Future) -> None:
        self.free += 1
        if not future.cancelled():
            if (exc := done.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(done.result())
        self._dispatch()
