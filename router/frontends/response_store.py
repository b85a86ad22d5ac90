"""The Responses API's store: responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded and in memory, per API key: each key keeps at most MAX_RESPONSES_PER_KEY responses and MAX_BYTES_PER_KEY
bytes of them (their JSON), each for at most TTL_SECONDS after it was made; past either cap the key's own oldest
go first, so one key's responses never push out another's, and the whole store is bounded by the keys the operator
configured. All of them are gone when the router restarts. A stored response is its key's alone: another key asking
for it is told it does not exist (404), as it is for a request id. What is kept is what a continuation needs: the
conversation up to and including this response (its chat messages) and the Response object as it was answered.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES_PER_KEY = 1024
MAX_BYTES_PER_KEY = 32 * 1024 * 1024
TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class Stored:
    owner: str  # the API key's name
    response: dict[str, Any]  # the Response object
    messages: list[dict[str, Any]]  # the chat so far, this response's output included
    at: float
    nbytes: int  # what it takes, as the JSON of both


class ResponseStore:
    def __init__(
        self,
        limit: int = MAX_RESPONSES_PER_KEY,
        ttl: float = TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        max_bytes: int = MAX_BYTES_PER_KEY,
    ) -> None:
        self.limit, self.ttl, self.clock, self.max_bytes = limit, ttl, clock, max_bytes
        self._keys: dict[str, OrderedDict[str, Stored]] = {}  # by owner, each oldest first
        self._bytes: dict[str, int] = {}

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keeps `response`; past its key's caps, that key's oldest go (never the one just kept)."""
        self._expire(owner)
        nbytes = len(json.dumps(response)) + len(json.dumps(messages))
        items = self._keys.setdefault(owner, OrderedDict())
        items[response["id"]] = Stored(owner, response, messages, self.clock(), nbytes)
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        while len(items) > 1 and (len(items) > self.limit or self._bytes[owner] > self.max_bytes):
            self._drop(owner, next(iter(items)))

    def get(self, owner: str, response_id: str) -> Stored | None:
        """The stored response, if it is `owner`'s and not expired."""
        self._expire(owner)
        return self._keys.get(owner, {}).get(response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        self._drop(owner, response_id)
        return True

    def kept_by(self, owner: str) -> tuple[int, int]:
        """How many responses `owner` has stored, and their bytes."""
        self._expire(owner)
        return len(self._keys.get(owner, {})), self._bytes.get(owner, 0)

    def _drop(self, owner: str, response_id: str) -> None:
        items = self._keys[owner]
        self._bytes[owner] -= items.pop(response_id).nbytes
        if not items:
            del self._keys[owner], self._bytes[owner]

    def _expire(self, owner: str) -> None:
        deadline = self.clock() - self.ttl
        while (items := self._keys.get(owner)) and next(iter(items.values())).at < deadline:
            self._drop(owner, next(iter(items)))

    def __len__(self) -> int:
        for owner in list(self._keys):
            self._expire(owner)
        return sum(len(items) for items in self._keys.values())
