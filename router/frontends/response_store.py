"""The Responses API's store: responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded and in memory: at most MAX_RESPONSES, each for at most TTL_SECONDS after it was made, the oldest dropped
first, and all of them gone when the router restarts. A stored response is its key's alone: another key asking for
it is told it does not exist (404), as it is for a request id. What is kept is what a continuation needs: the
conversation up to and including this response (its chat messages) and the Response object as it was answered.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 1024
TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class Stored:
    owner: str  # the API key's name
    response: dict[str, Any]  # the Response object
    messages: list[dict[str, Any]]  # the chat so far, this response's output included
    at: float


class ResponseStore:
    def __init__(
        self, limit: int = MAX_RESPONSES, ttl: float = TTL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit, self.ttl, self.clock = limit, ttl, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[response["id"]] = Stored(owner, response, messages, self.clock())
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, owner: str, response_id: str) -> Stored | None:
        """The stored response, if it is `owner`'s and not expired."""
        self._expire()
        stored = self._items.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        if self.get(owner, response_id) is None:
            return False
        del self._items[response_id]
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl
        while self._items and next(iter(self._items.values())).at < deadline:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
