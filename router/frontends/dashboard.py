"""A live page for whoever runs the server: `GET /dashboard` (one HTML file, no build step, nothing fetched from
elsewhere, so it works offline and behind a firewall) and `GET /dashboard/state`, the figures it polls.

The page is open, like `/health`; its figures name requests and their keys, so `/dashboard/state` is behind the
API key (middleware.PRIVATE_GETS), and shows a key only its own requests unless it is an admin key.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from conveyor.router.api import service as api
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import caller
from conveyor.router.frontends.service_routes import rows
from conveyor.router.server_info import ServerInfo

PAGE = (Path(__file__).parent / "dashboard.html").read_text(encoding="utf-8")

# The page runs its own inline script and style and talks to this server only: a browser refuses anything else,
# so a page that tried to load a CDN script would break in tests rather than in someone's air-gapped rack.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "Cache-Control": "no-store",
}


class Dashboard:
    def __init__(self, infer: Infer, info: ServerInfo) -> None:
        self.infer = infer
        self.info = info

    def register(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/state", self.state)

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html", charset="utf-8", headers=HEADERS)

    async def state(self, request: web.Request) -> web.Response:
        """Everything the page shows, read at once; the page keeps the history its charts draw."""
        groups, live, key = self.infer.groups, self.infer.live, caller(request)
        waiting = groups.queue.by_priority()
        body: api.DashboardState = {
            "model": self.info.model_id,
            "dtype": self.info.model_dtype,
            "device": self.info.device,
            "engine": self.info.engine,
            "num_shard": self.info.num_shard,
            "status": "recovering" if groups.recovering else "serving",
            "restarts": int(_counter(self.infer.metrics.shard_restarts)),
            "speculative": {
                "drafted": int(_counter(self.infer.metrics.speculative_drafted)),
                "accepted": int(_counter(self.infer.metrics.speculative_accepted)),
            },
            "adapters": self._adapters(),
            "queue_by_priority": {str(priority): count for priority, count in waiting.items()},
            "queue_length": sum(waiting.values()),
            "batch_size": len(groups.running),
            "kv": self._kv(),
            "groups": [groups.describe_group(i) for i in range(len(groups.schedulers))],
            "tokens_per_s": round(live.tokens_per_s(), 2),
            "ttft": live.ttft(),
            "itl": live.itl(),
            "requests": rows(self.infer.of(key)),
            "caller": {"name": key.name, "admin": key.admin},
            "time": time.time(),
        }
        return web.json_response(body, headers={"Cache-Control": "no-store"})

    def _adapters(self) -> dict[str, api.AdapterUse]:
        """Requests and tokens since the start, for each LoRA adapter served now."""
        registry, use = self.infer.metrics.registry, {}
        for name in self.infer.adapters.names():
            labels = {"adapter": name}
            requests = registry.get_sample_value("conveyor_adapter_requests_total", labels) or 0
            tokens = registry.get_sample_value("conveyor_adapter_generated_tokens_total", labels) or 0
            use[name] = {"requests": int(requests), "tokens": int(tokens)}
        return use

    def _kv(self) -> api.KvBlocks:
        """The pool in three parts that add up: held by requests, cached for prefix hits only, empty."""
        stats = self.infer.groups.pool()
        used = stats.num_blocks - stats.free_list - stats.evictable
        dtype = self.info.kv_cache_dtype or self.info.model_dtype
        disk = int(_gauge(self.infer.metrics.kv_offload_bytes))
        counts = {"total": stats.num_blocks, "used": used, "cached": stats.evictable, "free": stats.free_list}
        return {**counts, "dtype": dtype, "disk_bytes": disk}


def _gauge(gauge) -> float:
    """A label-less prometheus Gauge's value, through its public `collect()`."""
    return next(s.value for s in gauge.collect()[0].samples)


def _counter(counter) -> float:
    """A label-less prometheus Counter's value, through its public `collect()`."""
    return next(s.value for s in counter.collect()[0].samples if s.name.endswith("_total"))
