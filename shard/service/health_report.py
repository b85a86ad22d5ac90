"""The standard gRPC health service's answer, kept true: SERVING while steps keep their deadline, NOT_SERVING
while one runs past it (the watch in shard/service/watchdog.py tells which), for the whole server ("") and the
Shard service alike, so that whatever supervises the shard (Kubernetes, a compose health check) can restart it.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from conveyor.shard.service.watchdog import WATCH_SECONDS, StepWatch
from conveyor.v1 import shard_pb2 as pb

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SHARD_SERVICE = pb.DESCRIPTOR.services_by_name["Shard"].full_name


class HealthReport:
    """Keeps the standard health service's answer true, for the whole server ("") and the Shard service."""

    def __init__(self, watch: StepWatch, health_service: health.aio.HealthServicer) -> None:
        self.watch, self.health_service = watch, health_service
        self.stuck: str | None = None  # why the shard was last reported NOT_SERVING

    async def run(self) -> None:
        """Reports SERVING (the server just started), then brings the answer up to date every WATCH_SECONDS."""
        await self.set(SERVING)
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            await self.update()

    async def update(self) -> None:
        """Tells the health service only when the answer changes (and logs why)."""
        stuck, was = self.watch.stuck(), self.stuck
        self.stuck = stuck
        if (stuck is None) == (was is None):
            return
        await self.set(SERVING if stuck is None else NOT_SERVING)
        if stuck is not None:
            log.error("health: not serving", extra={"reason": stuck})
        else:
            log.warning("health: serving again")

    async def set(self, status: int) -> None:
        """Sets `status` for both names a client may ask about."""
        for name in ("", SHARD_SERVICE):
            await self.health_service.set(name, status)
