"""The HTTP server (aiohttp): every route and middleware assembled into one app, and the routes no API owns
(`/metrics`, `/openapi.json`)."""

from __future__ import annotations

import logging

from aiohttp import web

from conveyor import __version__
from conveyor.keys import ApiKey, KeyRing
from conveyor.router.core.infer import Infer
from conveyor.router.frontends import openapi
from conveyor.router.frontends.adapter_routes import AdapterRoutes
from conveyor.router.frontends.anthropic_routes import AnthropicRoutes
from conveyor.router.frontends.connections import ConnectionLimits, body_deadline_middleware, refuse_large_expectations
from conveyor.router.frontends.dashboard import Dashboard
from conveyor.router.frontends.embedding_routes import EmbeddingRoutes
from conveyor.router.frontends.group_routes import GroupRoutes
from conveyor.router.frontends.malformed import quiet_malformed_requests
from conveyor.router.frontends.middleware import (
    draining_middleware,
    hide_server_version,
    json_body_middleware,
    json_errors_middleware,
    json_protocol_errors,
    key_middleware,
    refuse_without_key,
    send_request_id,
    trace_middleware,
)
from conveyor.router.frontends.openai_routes import OpenAIRoutes
from conveyor.router.frontends.replies import UNAUTHORIZED, VALIDATION, json_error
from conveyor.router.frontends.responses_api_routes import ResponsesRoutes
from conveyor.router.frontends.service_routes import RequestControl
from conveyor.router.frontends.tgi_routes import TgiRoutes
from conveyor.router.pipeline.openai_requests import OpenAIRequests
from conveyor.router.pipeline.prompt_requests import Tasks
from conveyor.router.pipeline.validation import Validation
from conveyor.router.server_info import ServerInfo

log = logging.getLogger(__name__)


# Refusals that never reach `Infer`, which counts the others (overloaded, generation) itself.
_UNQUEUED_REFUSALS = {VALIDATION.status: VALIDATION.error_type, UNAUTHORIZED.status: UNAUTHORIZED.error_type}


class HttpServer:
    def __init__(
        self,
        infer: Infer,
        validation: Validation,
        info: ServerInfo,
        keys: KeyRing | None = None,
        payload_limit: int = 2_000_000,
        connections: ConnectionLimits | None = None,
        metrics_key: str | None = None,
        tasks: Tasks | None = None,
    ) -> None:
        # The metrics key as a ring of its own: one way to read and compare a `Bearer` credential.
        self.metrics_keys = KeyRing((ApiKey("metrics", metrics_key),)) if metrics_key else None
        self.infer = infer
        self.connections = connections or ConnectionLimits()
        self.validation = validation
        self.info = info
        self.keys = keys or KeyRing()
        self.payload_limit = payload_limit
        self.tasks = tasks or Tasks()  # the prompt-only routes served (--task)
        self.draining = False

    def app(self) -> web.Application:
        json_protocol_errors()
        quiet_malformed_requests()
        app = web.Application(
            client_max_size=self.payload_limit,
            middlewares=[
                trace_middleware,
                self._count_refusals,
                json_errors_middleware,
                key_middleware(self.keys),
                draining_middleware(lambda: self.draining),
                body_deadline_middleware(self.connections.body_timeout, self.payload_limit),
                json_body_middleware,
            ],
        )
        app.on_response_prepare.append(send_request_id)
        app.on_response_prepare.append(hide_server_version)
        TgiRoutes(self.infer, self.validation, self.info, lambda: self.draining).register(app)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/openapi.json", self.get_openapi)
        requests, model_id = OpenAIRequests(self.validation), self.info.model_id
        OpenAIRoutes(self.infer, requests, model_id).register(app)
        ResponsesRoutes(self.infer, requests, model_id).register(app)
        AnthropicRoutes(self.infer, requests, model_id).register(app)
        EmbeddingRoutes(self.infer, self.validation, self.tasks, model_id).register(app)
        RequestControl(self.infer).register(app)
        AdapterRoutes(self.infer).register(app)
        GroupRoutes(self.infer).register(app)
        Dashboard(self.infer, self.info).register(app)
        refuse_large_expectations(app, self.payload_limit, refuse_without_key(self.keys))
        return app

    @web.middleware
    async def _count_refusals(self, request: web.Request, handler) -> web.StreamResponse:
        """Requests refused before they reach the queue (the queue and streams count the rest). Anthropic's routes
        answer a refusal with its own status (400, not 422) and keep Conveyor's `error_type` on the answer."""
        response = await handler(request)
        outcome = _UNQUEUED_REFUSALS.get(response.status)
        if outcome is None and response.get("error_type") in _UNQUEUED_REFUSALS.values():
            outcome = response["error_type"]
        if outcome is not None:
            self.infer.metrics.requests.labels(outcome).inc()
        return response

    async def get_openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi.document(__version__, self.info.limits))

    async def get_metrics(self, request: web.Request) -> web.Response:
        """Open, unless a --metrics-key is set: then that key or an admin key (the per-key figures name every
        tenant and show what each is doing)."""
        if self.metrics_keys is not None and not self._may_read_metrics(request.headers.get("Authorization", "")):
            return json_error(401, "GET /metrics needs the metrics key or an admin key: Bearer <key>", "unauthorized")
        body, content_type = self.infer.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _may_read_metrics(self, authorization: str) -> bool:
        assert self.metrics_keys is not None
        if self.metrics_keys.identify(authorization) is not None:
            return True
        key = self.keys.identify(authorization) if not self.keys.open else None
        return key is not None and key.admin
