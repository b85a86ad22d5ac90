"""Python clients for Conveyor's gRPC front door, shaped like Hugging Face's `text-generation` client.

Code moves between them by changing the import: `generate(prompt, max_new_tokens=..., ...)` returns a
`Response` with `generated_text` and `details`; `generate_stream(...)` yields `StreamResponse`s whose `token`
has `id`, `text`, `logprob` and `special`. Errors arrive as exceptions named for what went wrong.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from conveyor.v1 import generate_pb2 as pb
from conveyor.v1 import generate_pb2_grpc as pb_grpc


class ConveyorError(Exception):
    """Base of every error the clients raise; `code` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class ValidationError(ConveyorError):
    """The request was refused as invalid (HTTP 422)."""


class OverloadedError(ConveyorError):
    """Too many requests in flight (HTTP 429): retry later."""


class GenerationError(ConveyorError):
    """The generation failed on the server (HTTP 424)."""


class UnauthorizedError(ConveyorError):
    """Missing or wrong API key (HTTP 401)."""


class CancelledError(ConveyorError):
    """The request was cancelled by its id (`cancel`, or HTTP's `DELETE /v1/requests/{id}`) before it finished."""


class NotFoundError(ConveyorError):
    """No request of that id is queued or running for this API key (HTTP 404)."""


class ConnectionError(ConveyorError):  # noqa: A001 - the name users expect beside the others
    """The server could not be reached, or the call timed out."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: ValidationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: GenerationError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthorizedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ConnectionError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
}


def _error(exc: grpc.RpcError) -> ConveyorError:
    code = exc.code()
    details = exc.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
        return ConnectionError(details, code)
    return _ERRORS.get(code, ConveyorError)(details, code)


@dataclass(frozen=True)
class Token:
    id: int
    text: str
    logprob: float | None
    special: bool


@dataclass(frozen=True)
class Details:
    finish_reason: str  # length | eos_token | stop_sequence
    generated_tokens: int
    seed: int | None
    prefill: list[Token] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    accepted_tokens: int = 0
    prefill_cached_tokens: int = 0  # prompt tokens served from the server's prefix cache, not computed


@dataclass(frozen=True)
class Response:
    generated_text: str
    details: Details | None


@dataclass(frozen=True)
class StreamResponse:
    token: Token
    top_tokens: list[Token]
    generated_text: str | None
    details: Details | None


@dataclass(frozen=True)
class TokenOffset:
    id: int
    text: str
    start: int
    stop: int


def _token(t: pb.Token) -> Token:
    return Token(t.id, t.text, t.logprob if t.HasField("logprob") else None, t.special)


def _details(d: pb.Details) -> Details:
    return Details(
        finish_reason=d.finish_reason,
        generated_tokens=d.generated_tokens,
        seed=d.seed if d.HasField("seed") else None,
        prefill=[_token(t) for t in d.prefill],
        tokens=[_token(t) for t in d.tokens],
        top_tokens=[[_token(t) for t in top.tokens] for top in d.top_tokens],
        drafted_tokens=d.drafted_tokens,
        accepted_tokens=d.accepted_tokens,
        prefill_cached_tokens=d.prefill_cached_tokens,
    )


def _response(r: pb.GenerateResponse) -> Response:
    return Response(r.generated_text, _details(r.details) if r.HasField("details") else None)


def _stream_response(r: pb.StreamResponse) -> StreamResponse:
    return StreamResponse(
        token=_token(r.token),
        top_tokens=[_token(t) for t in r.top_tokens],
        generated_text=r.generated_text if r.HasField("generated_text") else None,
        details=_details(r.details) if r.HasField("details") else None,
    )


def _request(
    prompt: str,
    *,
    do_sample: bool = False,
    max_new_tokens: int = 20,
    stop_sequences: list[str] | None = None,
    details: bool = True,
    top_n_tokens: int | None = None,
    json_schema: dict | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
    **parameters: Any,
) -> pb.GenerateRequest:
    """`text-generation`'s parameters (and defaults: 20 new tokens, greedy, details on), plus at most one
    structured-output constraint: a JSON schema, any JSON object, a regex, a choice, or a Lark grammar. Any other
    field of the proto's `Parameters` (temperature, top_k, top_p, typical_p, min_p, seed, repetition_penalty,
    frequency_penalty, presence_penalty, truncate, ignore_eos, return_full_text, decoder_input_details,
    speculate...) goes by its name; None leaves it unset, and a name the proto does not have is a TypeError."""
    unknown = sorted(set(parameters) - set(pb.Parameters.DESCRIPTOR.fields_by_name))
    if unknown:
        raise TypeError(f"unknown parameter `{unknown[0]}`")
    fields = pb.Parameters(
        do_sample=do_sample,
        max_new_tokens=max_new_tokens,
        stop=stop_sequences or [],
        details=details,
        top_n_tokens=top_n_tokens or 0,
        constraint=_constraint(json_schema, json_object, regex, choice, grammar),
        **{k: v for k, v in parameters.items() if v is not None},
    )
    return pb.GenerateRequest(inputs=prompt, parameters=fields)


def _constraint(
    json_schema: dict | str | None, json_object: bool, regex: str | None, choice: list[str] | None, grammar: str | None
) -> pb.Constraint | None:
    given = {
        "json_schema": json_schema if not isinstance(json_schema, dict) else json.dumps(json_schema),
        "json_object": json_object or None,
        "regex": regex,
        "choice": pb.Choices(choices=choice) if choice is not None else None,
        "grammar": grammar,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"at most one constraint per request; given {', '.join(given)}")
    return pb.Constraint(**given) if given else None


@dataclass
class _Options:
    address: str
    api_key: str | None = None
    timeout: float | None = None
    tls: bool = False
    root_certificates: bytes | None = None
    metadata: list[tuple[str, str]] = field(default_factory=list)

    def call_metadata(self, request_id: str | None = None) -> list[tuple[str, str]]:
        auth = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []
        named = [("x-request-id", request_id)] if request_id else []
        return [*auth, *named, *self.metadata]

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


class Client:
    """Blocking client. `Client("127.0.0.1:3001", api_key=..., timeout=30, tls=False, metadata=[...])`."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        metadata: list[tuple[str, str]] | None = None,
    ) -> None:
        self._options = _Options(address, api_key, timeout, tls, root_certificates, list(metadata or []))
        o = self._options
        self._channel = grpc.secure_channel(address, o.credentials()) if tls else grpc.insecure_channel(address)
        self._stub = pb_grpc.TextGenerationStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _kwargs(self, request_id: str | None = None) -> dict:
        return {"timeout": self._options.timeout, "metadata": self._options.call_metadata(request_id)}

    def generate(self, prompt: str, *, request_id: str | None = None, **parameters) -> Response:
        """`request_id` names the request, so that it can be listed and cancelled while it runs."""
        try:
            return _response(self._stub.Generate(_request(prompt, **parameters), **self._kwargs(request_id)))
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def generate_stream(self, prompt: str, *, request_id: str | None = None, **parameters) -> Iterator[StreamResponse]:
        """Leaving the loop early cancels the call, and the server frees the request's batch slot."""
        call = self._stub.GenerateStream(_request(prompt, **parameters), **self._kwargs(request_id))
        try:
            for message in call:
                yield _stream_response(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    def tokenize(self, prompt: str) -> list[TokenOffset]:
        try:
            response = self._stub.Tokenize(pb.TokenizeRequest(inputs=prompt), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return [TokenOffset(t.id, t.text, t.start, t.stop) for t in response.tokens]

    def info(self) -> pb.ServerInfoResponse:
        try:
            return self._stub.Info(pb.ServerInfoRequest(), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def list_requests(self) -> list[pb.RequestState]:
        """This key's requests queued or running (every key's, for an admin key)."""
        try:
            return list(self._stub.ListRequests(pb.ListRequestsRequest(), **self._kwargs()).requests)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def cancel(self, request_id: str) -> None:
        """Cancels a queued or running request of this key (any key's, for an admin key); NotFoundError if none."""
        try:
            self._stub.CancelRequest(pb.CancelRequestRequest(id=request_id), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None


class AsyncClient:
    """asyncio client with the same methods; `generate_stream` is an async iterator."""

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        metadata: list[tuple[str, str]] | None = None,
    ) -> None:
        self._options = _Options(address, api_key, timeout, tls, root_certificates, list(metadata or []))
        o = self._options
        self._channel = grpc.aio.secure_channel(address, o.credentials()) if tls else grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.TextGenerationStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _kwargs(self, request_id: str | None = None) -> dict:
        return {"timeout": self._options.timeout, "metadata": self._options.call_metadata(request_id)}

    async def generate(self, prompt: str, *, request_id: str | None = None, **parameters) -> Response:
        try:
            return _response(await self._stub.Generate(_request(prompt, **parameters), **self._kwargs(request_id)))
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def generate_stream(
        self, prompt: str, *, request_id: str | None = None, **parameters
    ) -> AsyncIterator[StreamResponse]:
        call = self._stub.GenerateStream(_request(prompt, **parameters), **self._kwargs(request_id))
        try:
            async for message in call:
                yield _stream_response(message)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def tokenize(self, prompt: str) -> list[TokenOffset]:
        try:
            response = await self._stub.Tokenize(pb.TokenizeRequest(inputs=prompt), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return [TokenOffset(t.id, t.text, t.start, t.stop) for t in response.tokens]

    async def info(self) -> pb.ServerInfoResponse:
        try:
            return await self._stub.Info(pb.ServerInfoRequest(), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def list_requests(self) -> list[pb.RequestState]:
        try:
            return list((await self._stub.ListRequests(pb.ListRequestsRequest(), **self._kwargs())).requests)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def cancel(self, request_id: str) -> None:
        try:
            await self._stub.CancelRequest(pb.CancelRequestRequest(id=request_id), **self._kwargs())
        except grpc.RpcError as exc:
            raise _error(exc) from None
