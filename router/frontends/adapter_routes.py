"""Live LoRA loading: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, for an admin key.

The shards read an adapter's files themselves (each rank its own copy, as with the model), so the path is one on
their machines. Loading takes effect once every rank holds the adapter; unloading is refused while a request
queued or running uses it (409), and a request naming an unloaded adapter gets a 404 like any unknown one.
"""

from __future__ import annotations

from aiohttp import web

from conveyor.router.api import adapters as api
from conveyor.router.api.base import parse
from conveyor.router.core.adapter_registry import Adapter
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import refuse_non_admin
from conveyor.router.frontends.replies import REQUEST_ERRORS, error_response


def adapter_json(adapter: Adapter, with_source: bool) -> api.AdapterInfo:
    """An adapter as the API shows it; `with_source` (an admin key's answer, or the load that named it) adds where
    it was read from, a path on the shards' machines that an open route must not tell anyone."""
    info: api.AdapterInfo = {
        "name": adapter.name,
        "rank": adapter.rank,
        "weight_bytes": adapter.weight_bytes,
        "live": adapter.live,
    }
    if with_source:
        info["source"] = adapter.source
    return info


class AdapterRoutes:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        if (refusal := refuse_non_admin(request)) is not None:
            return refusal
        try:
            body = parse(api.LoadAdapterRequest, await request.read())
            adapter = await self.infer.adapters.load(self.infer.groups.clients, body.lora_name, body.lora_path)
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        info = adapter_json(adapter, with_source=True)  # the admin named the path: it may read it back
        loaded: api.AdapterLoaded = {"object": "lora_adapter", "status": "loaded", "adapter": info}
        return web.json_response(loaded)

    async def unload(self, request: web.Request) -> web.Response:
        if (refusal := refuse_non_admin(request)) is not None:
            return refusal
        try:
            body = parse(api.UnloadAdapterRequest, await request.read())
            await self.infer.adapters.unload(self.infer.groups.clients, body.lora_name)
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        unloaded: api.AdapterUnloaded = {"object": "lora_adapter", "status": "unloaded", "name": body.lora_name}
        return web.json_response(unloaded)
