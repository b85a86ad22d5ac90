"""What a malformed request leaves in the log: one INFO line without a traceback, and only a few per client address.

aiohttp logs every request it cannot parse (a negative Content-Length, a request line over 8190 bytes, a NUL in a
header) with `logger.exception`, and a body that does not decode as its Content-Encoding says once more after the
answer, when its lingering read raises again ("Unhandled exception"): about a dozen lines and a traceback each,
which anyone can send by the thousand without a key, to fill a disk or bury the errors that matter. The answers stay
aiohttp's (a 400, the connection closed); the record becomes one line, `malformed request`, with the client's address
and aiohttp's reason (not the bytes it quotes), within a token bucket per address and one for the whole server.
What the buckets hold back is counted and said in one summary line a minute later. Anything else aiohttp logs through
the same method (a handler's bug, a response it could not send) keeps its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from conveyor.router.frontends.middleware import unquoted_reason

log = logging.getLogger(__name__)

PER_CLIENT_BURST = 3  # lines one address may log at once...
PER_CLIENT_EVERY = 60.0  # ...then one per this many seconds
OVERALL_BURST = 20  # and every address together, so that many addresses (IPv6 has plenty) cannot flood it either
OVERALL_EVERY = 5.0
SUMMARY_AFTER = 60.0  # seconds from the first line held back to the line that counts them
MAX_CLIENTS = 4096  # addresses remembered (the least recent forgotten first), so that memory stays bounded too
MAX_REASON = 200  # characters of aiohttp's reason kept


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class TokenBuckets:
    """A token bucket per key: `burst` at once, then one more every `every` seconds. At most `max_keys` are kept, the
    least recently used dropped first (a dropped key starts again with a full bucket, which the overall one bounds)."""

    def __init__(
        self, burst: int, every: float, max_keys: int = MAX_CLIENTS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst, self.every, self.max_keys, self.clock = burst, every, max_keys, clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str) -> bool:
        """Whether `key` has a token now (taking it if so)."""
        now = self.clock()
        bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now)  # re-inserted last: most recent
        tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) / self.every)
        allowed = tokens >= 1.0
        self._buckets[key] = _Bucket(tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]
        return allowed


class MalformedRequests:
    """Logs malformed requests within the buckets and counts the rest, for a summary `SUMMARY_AFTER` seconds after
    the first one held back (scheduled on the running loop; without one, said at the next malformed request past
    that time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.per_client = TokenBuckets(PER_CLIENT_BURST, PER_CLIENT_EVERY, clock=clock)
        self.overall = TokenBuckets(OVERALL_BURST, OVERALL_EVERY, clock=clock)
        self.held: Counter[str] = Counter()
        self.held_since: float | None = None
        self._summary: asyncio.TimerHandle | None = None

    def note(self, client: str, error: BaseException) -> None:
        if self.held_since is not None and self.clock() - self.held_since >= SUMMARY_AFTER:
            self.summarize()
        if self.per_client.take(client) and self.overall.take(""):
            extra = {"client": client, "error": type(error).__name__, "reason": reason(error)}
            log.info("malformed request", extra=extra)
            return
        self._hold(client)

    def _hold(self, client: str) -> None:
        if self.held_since is None:
            self.held_since = self.clock()
            try:
                self._summary = asyncio.get_running_loop().call_later(SUMMARY_AFTER, self.summarize)
            except RuntimeError:  # no loop runs here: the next note past that time says it
                self._summary = None
        self.held[client if client in self.held or len(self.held) < MAX_CLIENTS else "other"] += 1

    def summarize(self) -> None:
        """One line for what was held back since the last: how many, from how many addresses, the busiest one."""
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if not self.held:
            return
        (busiest, most), *_ = self.held.most_common(1)
        extra = {"count": self.held.total(), "clients": len(self.held), "busiest": busiest, "from_busiest": most}
        log.info("malformed requests not logged", extra=extra)
        self.held.clear()
        self.held_since = None


def reason(error: BaseException) -> str:
    """aiohttp's reason, without the request bytes it quotes (a header line, keys included)."""
    cause = error.__cause__ if isinstance(error, RequestPayloadError) and error.__cause__ is not None else error
    text = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
    return unquoted_reason(text)[:MAX_REASON]


def is_malformed(error: object) -> bool:
    """An error the client's bytes caused: a request aiohttp could not parse, or a body it could not decode."""
    return isinstance(error, (BadHttpMessage, RequestPayloadError))


MALFORMED = MalformedRequests()  # this process's: aiohttp's handlers are patched once, for every server in it


def quiet_malformed_requests() -> None:
    """Routes aiohttp's `RequestHandler.log_exception` (its only path for the errors above, besides a first-line
    `BadHttpMethod` that it logs at DEBUG itself) through `MALFORMED` for malformed requests; other records go on
    as before. aiohttp has no setting for this, so the method is wrapped, once for this process."""
    original = RequestHandler.log_exception
    if getattr(original, "conveyor_quiet", False):
        return

    def log_exception(self: RequestHandler, *args: object, **kw: object) -> None:
        error = kw.get("exc_info")
        if error is True:
            error = sys.exc_info()[1]
        if is_malformed(error):
            assert isinstance(error, BaseException)
            MALFORMED.note(_client(self), error)
        else:
            original(self, *args, **kw)

    log_exception.conveyor_quiet = True  # type: ignore[attr-defined]
    RequestHandler.log_exception = log_exception  # type: ignore[method-assign]


def _client(handler: RequestHandler) -> str:
    transport = handler.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
