"""The requests in flight as their callers (or an admin) see and cancel them: `GET /v1/requests` and
`DELETE /v1/requests/{id}`, and the rows the gRPC front door and the dashboard show."""

from __future__ import annotations

import time

from aiohttp import web

from conveyor.router.api import service as api
from conveyor.router.core.infer import Infer
from conveyor.router.core.sequence import Sequence, SequenceStatus
from conveyor.router.frontends.middleware import caller
from conveyor.router.frontends.replies import json_error


def request_row(sequence: Sequence, now: float) -> api.RequestState:
    return {
        "id": sequence.request_id,
        "key": sequence.key.name,
        "state": "running" if sequence.status is SequenceStatus.RUNNING else "queued",
        "priority": sequence.priority,
        "prompt_tokens": sequence.num_prompt_tokens,
        "generated_tokens": len(sequence.generated_ids),
        "max_new_tokens": sequence.max_new_tokens,
        "age_s": round(now - sequence.queued_at, 3),
    }


def rows(sequences: list[Sequence]) -> list[api.RequestState]:
    """The unfinished ones among `sequences`, oldest first."""
    now = time.monotonic()
    return [request_row(s, now) for s in sequences if not s.is_finished]


class RequestControl:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer

    def register(self, app: web.Application) -> None:
        app.router.add_get("/v1/requests", self.list)
        app.router.add_delete("/v1/requests/{id}", self.cancel)

    async def list(self, request: web.Request) -> web.Response:
        """The caller's requests queued or running (every key's, for an admin key)."""
        body: api.RequestList = {"object": "list", "data": rows(self.infer.of(caller(request)))}
        return web.json_response(body)

    async def cancel(self, request: web.Request) -> web.Response:
        """Ends a queued or running request; 404 when none of that id is in flight for this key (another key's
        requests are not even said to exist)."""
        request_id = request.match_info["id"]
        if not self.infer.cancel(request_id, caller(request)):
            message = f"no request {request_id!r} is queued or running for this API key"
            return json_error(404, message, "not_found")
        body: api.Cancelled = {"id": request_id, "status": "cancelled"}
        return web.json_response(body)
