"""Conveyor's Python clients: `Client` and `AsyncClient` over the gRPC front door (see `client.py`). The router's
own transport to its shards is not public API and lives with it (`conveyor.router.transport.shard_client`)."""

from conveyor.client.client import (
    AsyncClient,
    CancelledError,
    Client,
    ConnectionError,
    ConveyorError,
    Details,
    GenerationError,
    NotFoundError,
    OverloadedError,
    Response,
    StreamResponse,
    Token,
    TokenOffset,
    UnauthorizedError,
    ValidationError,
)

__all__ = [
    "AsyncClient",
    "CancelledError",
    "Client",
    "ConnectionError",
    "ConveyorError",
    "Details",
    "GenerationError",
    "NotFoundError",
    "OverloadedError",
    "Response",
    "StreamResponse",
    "Token",
    "TokenOffset",
    "UnauthorizedError",
    "ValidationError",
]
