"""How the router and the launchers reach shards: each rank's address, the shared token, TLS.

On one host, shards listen on unix sockets in a private directory, which only their user can open. Between hosts
they listen on TCP, where anyone who can route a packet could drive them, so a shard on TCP demands a shared
token in every call's metadata (the standard health service alone answers without it, for probes) and may
serve TLS, mutual when given a CA. Every process of a deployment gets the same flags, so the one `Security`
built from them fits both ends.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc

from conveyor.config import Config

TOKEN_METADATA = "x-conveyor-shard-token"
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
LOOPBACK = "127.0.0.1"
# Probes (Kubernetes' gRPC probe, the compose healthcheck) carry no token; this service reveals nothing.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class AddressError(ValueError):
    pass


def parse_tcp(url: str) -> tuple[str, int]:
    """`tcp://HOST:PORT` (HOST may be empty: loopback) as (host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or port is None or parts.path not in ("", "/"):
        raise AddressError(f"{url!r} is not tcp://HOST:PORT")
    return parts.hostname or LOOPBACK, port


def target(url: str) -> str:
    """The gRPC target of a shard URL: `unix://PATH` stays, `tcp://HOST:PORT` becomes HOST:PORT."""
    if url.startswith("tcp://"):
        host, port = parse_tcp(url)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return url if url.startswith("unix:") else f"unix://{url}"


@dataclass(frozen=True)
class RankAddress:
    bind: str  # the gRPC address the rank's server binds
    url: str  # how the router and the other ranks reach it (what ServiceDiscovery answers)


def rank_address(config: Config, rank: int, local_rank: int) -> RankAddress:
    """Unix sockets are `{--shard-uds-path}-{rank}`; on TCP, local rank i listens on the --listen port + i and is
    reached at --advertise-host (default: the --listen host; a wildcard bind is reached on loopback)."""
    if config.listen is None:
        path = f"{config.shard_uds_path}-{rank}"
        return RankAddress(f"unix://{path}", f"unix://{path}")
    host, port = parse_tcp(config.listen)
    port += local_rank
    reach = config.advertise_host or (LOOPBACK if host in ("0.0.0.0", "::") else host)
    return RankAddress(target(f"tcp://{host}:{port}"), f"tcp://{reach}:{port}")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class Security:
    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    @classmethod
    def from_config(cls, config: Config) -> Security:
        if bool(config.shard_tls_cert) != bool(config.shard_tls_key):
            raise AddressError("--shard-tls-cert and --shard-tls-key go together")
        return cls(
            config.shard_token or None,
            _read(config.shard_tls_cert),
            _read(config.shard_tls_key),
            _read(config.shard_tls_ca),
        )

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    def metadata(self) -> list[tuple[str, str]]:
        return [(TOKEN_METADATA, self.token)] if self.token else []

    # --- shard side -------------------------------------------------------------------------------------------

    def add_port(self, server: grpc.aio.Server, bind: str) -> None:
        """TLS on TCP only, as the router's channels do: a unix socket stays within the host."""
        if self.cert is None or bind.startswith("unix:"):
            server.add_insecure_port(bind)
            return
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.ca is not None
        )
        server.add_secure_port(bind, credentials)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [_TokenCheck(self.token)] if self.token else []

    # --- router and launcher side -----------------------------------------------------------------------------

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def aio_channel(self, url: str) -> grpc.aio.Channel:
        metadata = self.metadata()
        interceptors = [_TokenSender(metadata), _StreamTokenSender(metadata)] if self.token else None
        if self.tls and url.startswith("tcp://"):
            return grpc.aio.secure_channel(target(url), self._credentials(), CHANNEL_OPTIONS, interceptors=interceptors)
        return grpc.aio.insecure_channel(target(url), CHANNEL_OPTIONS, interceptors=interceptors)

    def channel(self, url: str) -> grpc.Channel:
        """A blocking channel (the launcher's readiness checks); calls pass `metadata()` themselves."""
        if self.tls and url.startswith("tcp://"):
            return grpc.secure_channel(target(url), self._credentials(), CHANNEL_OPTIONS)
        return grpc.insecure_channel(target(url), CHANNEL_OPTIONS)


class _Token:
    """The deployment's token, added to the metadata of a call."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = metadata

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *self._metadata))


class _TokenSender(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    """...of every unary call."""

    async def intercept_unary_unary(self, continuation, details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamTokenSender(_Token, grpc.aio.StreamStreamClientInterceptor):
    """...and of every stream (`Steps`, `DecodeRun`): a channel files each interceptor under one kind only."""

    async def intercept_stream_stream(
        self, continuation, details: grpc.aio.ClientCallDetails, request_iterator: Any
    ) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses, with UNAUTHENTICATED, a call without the deployment's token (compared in constant time)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "this shard needs the deployment's shard token")

        self._refuse = grpc.unary_unary_rpc_method_handler(refuse)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._token):
            return await continuation(details)
        return self._refuse
