"""Conveyor's Python clients: `Client` and `AsyncClient` over the gRPC front door (see `client.py`), and the
sharded client the router drives its shards with (`sharded_client.py`)."""

from conveyor.client.client import (
    AsyncClient,
    Client,
    ConnectionError,
    ConveyorError,
    Details,
    GenerationError,
    OverloadedError,
    Response,
    StreamResponse,
    Token,
    TokenOffset,
    UnauthorizedError,
    ValidationError,
)

__all__ = [
    "AsyncClient", "Client", "ConnectionError", "ConveyorError", "Details", "GenerationError", "OverloadedError",
    "Response", "StreamResponse", "Token", "TokenOffset", "UnauthorizedError", "ValidationError",
]  # fmt: skip
