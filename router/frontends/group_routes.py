"""Taking one shard group out of placement for a deploy, and back: `POST /admin/groups/{index}/drain` and
`POST /admin/groups/{index}/resume`, for an admin key.

A drained group gets no new request; what waits on it goes to the others at once, and what runs there finishes
there (nothing moves mid-stream). The last group that serves is not drained (409): that would stop the server.
Once its `running` in `GET /info` is 0 it may be restarted or replaced; resuming puts it back in placement (a
restarted group rejoins on its own when its shards answer again).
"""

from __future__ import annotations

from aiohttp import web

from conveyor.router.core.groups import LastGroup
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import refuse_non_admin
from conveyor.router.frontends.replies import json_error


class GroupRoutes:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer

    def register(self, app: web.Application) -> None:
        app.router.add_post("/admin/groups/{index}/drain", self.drain)
        app.router.add_post("/admin/groups/{index}/resume", self.resume)

    async def drain(self, request: web.Request) -> web.Response:
        return self._change(request, self.infer.groups.drain)

    async def resume(self, request: web.Request) -> web.Response:
        return self._change(request, self.infer.groups.resume)

    def _change(self, request: web.Request, change) -> web.Response:
        if (refusal := refuse_non_admin(request)) is not None:
            return refusal
        groups = self.infer.groups
        index = request.match_info["index"]
        if not index.isdigit() or int(index) >= len(groups.schedulers):
            return json_error(404, f"no shard group {index!r}: there are {len(groups.schedulers)}", "not_found")
        try:
            change(int(index))
        except LastGroup as exc:
            return json_error(409, str(exc), "conflict")
        return web.json_response(groups.describe_group(int(index)))
