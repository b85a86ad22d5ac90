"""The gRPC front door (`TextGeneration`), served beside HTTP on `--grpc-port` over the same `Infer`.

Internal services get the same validation, queue and batching as HTTP clients, with typed messages and
server streaming. The standard gRPC health service reports SERVING once the router is up.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind

from conveyor import tracing
from conveyor.grammar import Constraint
from conveyor.keys import ApiKey, KeyRing
from conveyor.router.api.base import parse
from conveyor.router.api.constraints import build
from conveyor.router.api.tgi import GenerateParameters
from conveyor.router.core.events import ErrorEvent, ScoredToken, TokenEvent
from conveyor.router.core.infer import Answer, Infer
from conveyor.router.frontends.app import ServerInfo
from conveyor.router.frontends.middleware import name_request
from conveyor.router.frontends.replies import (
    REQUEST_ERRORS,
    UNAUTHORIZED,
    VALIDATION,
    AnswerDetails,
    details,
    failure_named,
    failure_of,
    full_text,
    logprob,
)
from conveyor.router.frontends.service_routes import rows
from conveyor.router.pipeline.request import Parameters, Request, ValidRequest, from_tgi
from conveyor.router.pipeline.validation import Validation
from conveyor.v1 import generate_pb2 as pb
from conveyor.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_SERVICE = "conveyor.v1.TextGeneration"


def constraint_from_pb(constraint: pb.Constraint) -> Constraint | None:
    """The gRPC front door's `Parameters.constraint`."""
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return build("choice", list(constraint.choice.choices), "constraint.choice")
    if kind == "json_object":
        return build("json_object", True, "constraint.json_object") if constraint.json_object else None
    return build(kind, getattr(constraint, kind), f"constraint.{kind}")


def parameters_from_pb(p: pb.Parameters) -> tuple[GenerateParameters, Constraint | None]:
    """The message's fields read by name into TGI's schema, which checks them as it checks HTTP's: only what the
    caller set (an unset `optional` field is absent), so validation applies the same defaults. A sampling field
    added to both the schema and the proto needs nothing here."""
    fields: dict[str, Any] = {}
    for field in p.DESCRIPTOR.fields:
        if field.name == "constraint" or (field.has_presence and not p.HasField(field.name)):
            continue
        value = getattr(p, field.name)
        if field.type == field.TYPE_FLOAT:
            value = float(f"{value:.7g}")  # float32 on the wire: 0.8 stays 0.8
        fields[field.name] = value if isinstance(value, (str, int, float)) else list(value)  # repeated: a list
    constraint = constraint_from_pb(p.constraint) if p.HasField("constraint") else None
    return parse(GenerateParameters, fields, "parameters"), constraint


def token_pb(token: ScoredToken) -> pb.Token:
    """A None `logprob` (or `seed`, in `details_pb`) leaves the optional field unset: the message's "none"."""
    return pb.Token(id=token.id, text=token.text, logprob=logprob(token), special=token.special)


def details_pb(d: AnswerDetails) -> pb.Details:
    return pb.Details(
        finish_reason=d.finish_reason,
        generated_tokens=d.generated_tokens,
        seed=d.seed,
        prefill=[token_pb(t) for t in d.prefill],
        tokens=[token_pb(t) for t in d.tokens],
        top_tokens=[pb.TopTokens(tokens=[token_pb(t) for t in top]) for top in d.top_tokens or ()],
        input_length=d.input_length,
        drafted_tokens=d.drafted_tokens,
        accepted_tokens=d.accepted_tokens,
        prefill_cached_tokens=d.prefill_cached_tokens,
    )


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """Ends the call with the status code of one of `REQUEST_ERRORS` (abort raises)."""
    await context.abort(failure_of(exc).grpc_code, str(exc))


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(self, infer: Infer, validation: Validation, info: ServerInfo, keys: KeyRing | None = None) -> None:
        self.infer = infer
        self.validation = validation
        self.info = info
        self.keys = keys or KeyRing()

    async def _authorize(self, context: grpc.aio.ServicerContext) -> ApiKey:
        key = self.keys.identify(dict(context.invocation_metadata() or ()).get("authorization", ""))
        if key is None:
            self.infer.metrics.requests.labels(UNAUTHORIZED.error_type).inc()
            await context.abort(UNAUTHORIZED.grpc_code, "a valid API key is required: Bearer <key>")
        assert key is not None
        return key

    async def _validate(self, request: pb.GenerateRequest, context, stream: bool, key: ApiKey) -> ValidRequest:
        """Admitted first (refused work costs no tokenizing), then validated in the key's turn."""
        try:
            self.infer.admit(key, 1)
            parameters, constraint = parameters_from_pb(request.parameters)
            mapped = from_tgi(request.inputs, parameters, stream=stream, grammar=constraint)
            return await self.validation.off_loop(self.validation.validate, mapped, owner=key.name)
        except REQUEST_ERRORS as exc:
            self.infer.metrics.requests.labels(failure_of(exc).error_type).inc()
            await _abort(context, exc)
            raise  # abort raises; this line is for type checkers

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        with _server_span("Generate", context):
            return await self._generate(request, context)

    async def _generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        key = await self._authorize(context)
        valid = await self._validate(request, context, stream=False, key=key)
        try:
            response: Answer = await self.infer.generate(valid, key, await _request_id(context))
        except REQUEST_ERRORS as exc:
            await _abort(context, exc)
        finished = response.finished
        reply = pb.GenerateResponse(generated_text=full_text(valid, finished.generated_text))
        if valid.parameters.details:
            reply.details.CopyFrom(details_pb(details(valid, finished, response.events, response.prefill)))
        return reply

    async def GenerateStream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.StreamResponse]:
        with _server_span("GenerateStream", context):
            async for message in self._generate_stream(request, context):
                yield message

    async def _generate_stream(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.StreamResponse]:
        key = await self._authorize(context)
        valid = await self._validate(request, context, stream=True, key=key)
        async with AsyncExitStack() as stack:  # leaving it, a cancelled call leaves the batch at the next step
            try:
                events = await stack.enter_async_context(self.infer.stream(valid, key, await _request_id(context)))
            except REQUEST_ERRORS as exc:
                await _abort(context, exc)
            index = 0
            async for event in events:
                if isinstance(event, ErrorEvent):
                    await context.abort(failure_named(event.error_type).grpc_code, event.message)
                index += 1
                yield self._stream_message(valid, event, index)

    def _stream_message(self, valid: ValidRequest, event: TokenEvent, index: int) -> pb.StreamResponse:
        top_tokens = [token_pb(t) for t in event.top_tokens]
        message = pb.StreamResponse(index=index, token=token_pb(event.token), top_tokens=top_tokens)
        if event.finished is not None:
            message.generated_text = full_text(valid, event.finished.generated_text)
            if valid.parameters.details:
                message.details.CopyFrom(details_pb(details(valid, event.finished)))
        return message

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        key = await self._authorize(context)
        try:
            valid = await self.validation.off_loop(
                self.validation.validate, Request(request.inputs, Parameters()), owner=key.name
            )
        except REQUEST_ERRORS as exc:
            await _abort(context, exc)
        tokens = await self.validation.off_loop(self.validation.token_offsets, valid, owner=key.name)
        return pb.TokenizeResponse(tokens=[pb.TokenOffset(id=i, text=t, start=a, stop=b) for i, t, a, b in tokens])

    async def ListRequests(self, request: pb.ListRequestsRequest, context) -> pb.ListRequestsResponse:
        key = await self._authorize(context)
        return pb.ListRequestsResponse(requests=[pb.RequestState(**row) for row in rows(self.infer.of(key))])

    async def CancelRequest(self, request: pb.CancelRequestRequest, context) -> pb.CancelRequestResponse:
        key = await self._authorize(context)
        if not self.infer.cancel(request.id, key):
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request {request.id!r} is queued or running for this key"
            )
        return pb.CancelRequestResponse(id=request.id, status="cancelled")

    async def Info(self, request: pb.ServerInfoRequest, context) -> pb.ServerInfoResponse:
        """`/info`'s fields that the message has, by name."""
        info = self.info.to_json()
        return pb.ServerInfoResponse(**{name: info[name] for name in pb.ServerInfoResponse.DESCRIPTOR.fields_by_name})


async def _request_id(context: grpc.aio.ServicerContext) -> str:
    """The call's `x-request-id` if it is a safe token, else a new one; sent back in the initial metadata."""
    name = name_request(dict(context.invocation_metadata() or ()).get("x-request-id", ""))
    await context.send_initial_metadata((("x-request-id", name),))
    return name


@dataclass(frozen=True)
class _Malformed:
    """A request whose bytes do not parse as its message (truncated, not protobuf, a string field that is not
    UTF-8). grpc's own deserializer would fail the call with UNKNOWN; this lets the handler answer
    INVALID_ARGUMENT, the client's mistake."""

    error: str


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the bytes were bad
            return _Malformed(f"the request is not a valid message: {exc}".strip())

    return parse


class _MalformedRequests(grpc.aio.ServerInterceptor):
    """Answers a TextGeneration call whose request does not parse with INVALID_ARGUMENT before the handler runs
    (a generation call is counted as a validation refusal, as a bad parameter is)."""

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{_SERVICE}/") or handler.request_streaming:
            return handler

        generation = details.method.rpartition("/")[2] in ("Generate", "GenerateStream")

        async def refuse(request: _Malformed, context: grpc.aio.ServicerContext) -> None:
            if generation:
                self.metrics.requests.labels(VALIDATION.error_type).inc()
            await context.abort(VALIDATION.grpc_code, request.error)

        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await behavior(request, context)

            return handler._replace(
                request_deserializer=_lenient(handler.request_deserializer), unary_unary=unary_unary
            )
        stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await refuse(request, context)
            async for message in stream(request, context):
                yield message

        return handler._replace(request_deserializer=_lenient(handler.request_deserializer), unary_stream=unary_stream)


def _server_span(method: str, context: grpc.aio.ServicerContext):
    """A server span continuing the caller's trace from `traceparent` in the call's metadata."""
    parent = tracing.extract(dict(context.invocation_metadata() or ()))
    return tracing.span(f"conveyor.v1.TextGeneration/{method}", parent, kind=SpanKind.SERVER)


async def start(service: TextGenerationService, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(interceptors=[_MalformedRequests(service.infer.metrics)])
    pb_grpc.add_TextGenerationServicer_to_server(service, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", _SERVICE):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.warning("grpc front door listening", extra={"address": f"{host}:{port}"})
    return server
