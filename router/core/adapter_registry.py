"""The LoRA adapters the shards serve, as the router knows them: which names a request may ask for, how many
requests use each, and loading and unloading them live on every rank.

The shards load `--lora-adapters` at their start and report them (`Info.adapters`); adapters loaded live are the
router's to remember, since a restarted shard group knows only its flags: they are loaded again before any request
is replayed. A name is served from the moment every rank holds it until an unload, which is refused while any
request queued or running uses it (so no step ever names an adapter a rank lacks).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.adapter_sources import AdapterSourceError, check_name
from conveyor.router.pipeline.validation import UnknownAdapter
from conveyor.router.transport.records import ShardAdapter, ShardInfo
from conveyor.router.transport.shard_client import ShardedClient, ShardError

log = logging.getLogger(__name__)
BATCH_POLL_SECONDS = 0.01


class AdapterConflict(RuntimeError):
    """Loading a name already served, past --max-loras, or unloading one that requests use (409)."""


class AdapterLoadError(ValueError):
    """The shards refused the adapter: it does not fit the base model, or its files cannot be read (400)."""


@dataclass(frozen=True)
class Adapter:
    name: str
    source: str
    rank: int
    weight_bytes: int  # rank 0's
    live: bool  # loaded through the API (reloaded after a shard restart), not from --lora-adapters

    @classmethod
    def held(cls, adapter: ShardAdapter, live: bool) -> Adapter:
        """The adapter as a rank reports holding it."""
        return cls(adapter.name, adapter.source, adapter.rank, adapter.weight_bytes, live)


class AdapterRegistry:
    def __init__(self, max_loras: int = 0) -> None:
        self.max_loras = max_loras
        self.served: dict[str, Adapter] = {}
        self.in_use: Counter[str] = Counter()  # requests queued or running, by adapter
        # Whether the shards' batch still holds a request of the adapter: one whose caller left stays there until
        # the next step filters it out (the scheduler sets this).
        self.in_batch: Callable[[str], bool] = lambda name: False
        self._lock = asyncio.Lock()  # one load or unload at a time

    def learn(self, info: ShardInfo) -> None:
        """What rank 0 holds after a (re)connection: its start adapters; and those this router loaded live, which
        restarted shards lack until `restore` loads them again."""
        self.max_loras = info.max_loras
        live = {name: adapter for name, adapter in self.served.items() if adapter.live}
        self.served = {a.name: Adapter.held(a, a.name in live) for a in info.adapters}
        for name, adapter in live.items():
            self.served.setdefault(name, adapter)

    def names(self) -> list[str]:
        return sorted(self.served)

    def check(self, name: str) -> None:
        if name not in self.served:
            raise UnknownAdapter.naming(name, self.served)

    def acquire(self, name: str | None) -> None:
        """A request for `name` (None: the base model) is in flight from now on."""
        if name is not None:
            self.check(name)
            self.in_use[name] += 1

    def release(self, name: str | None) -> None:
        if name is not None:
            self.in_use[name] -= 1
            if self.in_use[name] <= 0:
                del self.in_use[name]

    async def load(self, clients: list[ShardedClient], name: str, source: str) -> Adapter:
        """Loads the adapter on every rank of every shard group, or on none."""
        async with self._lock:
            try:
                check_name(name)
            except AdapterSourceError as exc:
                raise AdapterLoadError(str(exc)) from None
            if name in self.served:
                raise AdapterConflict(f"adapter {name!r} is already served; unload it first")
            if len(self.served) >= self.max_loras:
                raise AdapterConflict(
                    f"{len(self.served)} adapters are resident, the most --max-loras allows; unload one first"
                )
            try:
                loaded = [await client.load_adapter(name, source) for client in clients]
            except ShardError as exc:
                for client in clients:
                    await self._roll_back(client, name)
                raise AdapterLoadError(exc.detail) from None
            adapter = Adapter.held(loaded[0][0], live=True)
            self.served[name] = adapter
            log.info("adapter loaded", extra={"adapter": name, "source": source, "bytes": adapter.weight_bytes})
            return adapter

    async def unload(self, clients: list[ShardedClient], name: str) -> None:
        async with self._lock:
            self.check(name)
            if self.in_use[name]:
                raise AdapterConflict(f"adapter {name!r} is used by {self.in_use[name]} requests queued or running")
            del self.served[name]  # no new request may name it from here on
            while self.in_batch(name):  # a cancelled request leaves the batch at the next step
                await asyncio.sleep(BATCH_POLL_SECONDS)
            for client in clients:
                await client.unload_adapter(name)
            log.info("adapter unloaded", extra={"adapter": name})

    async def restore(self, client: ShardedClient) -> None:
        """After the shards were restarted: the live adapters loaded again, before any request is replayed."""
        for adapter in [a for a in self.served.values() if a.live]:
            try:
                await client.load_adapter(adapter.name, adapter.source)
            except ShardError as exc:  # its files moved or changed since: requests for it now fail with a 404
                log.error("adapter lost in the restart", extra={"adapter": adapter.name, "error": exc.detail})
                del self.served[adapter.name]

    async def _roll_back(self, client: ShardedClient, name: str) -> None:
        """A load that failed on some rank: the ranks that took it drop it again."""
        try:
            await client.unload_adapter(name)
        except ShardError:
            pass  # ranks that never loaded it refuse the unload
