"""router/frontends/malformed.py: a malformed request is one INFO line without a traceback, a few per client address
and a bounded number overall, with a summary of what was held back; a real server error keeps its traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, ContentEncodingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from conveyor.router.frontends import malformed
from conveyor.router.frontends.malformed import (
    OVERALL_BURST,
    PER_CLIENT_BURST,
    PER_CLIENT_EVERY,
    SUMMARY_AFTER,
    MalformedRequests,
    TokenBuckets,
    quiet_malformed_requests,
)
from conveyor.router.frontends.middleware import json_errors_middleware, json_protocol_errors

LOGGER = malformed.log.name


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.getMessage() == message]


def test_a_bucket_gives_its_burst_then_one_per_interval_and_forgets_the_least_recent() -> None:
    clock = Clock()
    buckets = TokenBuckets(3, 10.0, max_keys=2, clock=clock)
    assert [buckets.take("a") for _ in range(5)] == [True, True, True, False, False]
    clock.now += 10.0
    assert [buckets.take("a") for _ in range(2)] == [True, False]
    assert buckets.take("b") and buckets.take("c")  # a third address: "a", the least recent, is forgotten
    assert buckets.take("a") and buckets.take("a")  # ...and starts again full


def test_one_client_logs_its_burst_and_the_rest_is_one_summary_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    log = MalformedRequests(clock)
    for _ in range(200):
        log.note("203.0.113.9", LineTooLong("Status line is too long", "8190", "70000"))
    logged = lines(caplog, "malformed request")
    assert len(logged) == PER_CLIENT_BURST
    assert all(r.exc_info is None and r.levelno == logging.INFO for r in caplog.records)
    assert logged[0].client == "203.0.113.9" and logged[0].error == "LineTooLong"  # type: ignore[attr-defined]
    clock.now += SUMMARY_AFTER
    log.note("203.0.113.9", BadHttpMessage("bad Content-Length"))  # past the summary's time: it comes first
    (summary,) = lines(caplog, "malformed requests not logged")
    assert summary.count == 200 - PER_CLIENT_BURST and summary.busiest == "203.0.113.9"  # type: ignore[attr-defined]
    assert len(lines(caplog, "malformed request")) == PER_CLIENT_BURST + 1  # a minute on, a token again
    clock.now += PER_CLIENT_EVERY / 2
    log.note("203.0.113.9", BadHttpMessage("bad Content-Length"))
    log.summarize()
    assert len(lines(caplog, "malformed requests not logged")) == 2


def test_many_addresses_together_log_no_more_than_the_overall_burst(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    log = MalformedRequests(Clock())
    for i in range(1000):
        log.note(f"2001:db8::{i:x}", BadHttpMessage("bad"))
    assert len(lines(caplog, "malformed request")) == OVERALL_BURST
    log.summarize()
    (summary,) = lines(caplog, "malformed requests not logged")
    assert summary.count == 1000 - OVERALL_BURST and summary.clients == 1000 - OVERALL_BURST  # type: ignore[attr-defined]


def test_the_reason_is_aiohttps_without_the_bytes_it_quotes() -> None:
    error = BadHttpMessage("Invalid header value char:\n\n  b'Authorization: Bearer sk-secret\\x00'\n  ^")
    assert malformed.reason(error) == "Invalid header value char"
    too_long = LineTooLong(bytearray(b"GET /" + b"a" * 9000), 8190)
    assert malformed.reason(too_long) == "Got more than 8190 bytes when reading"
    payload = RequestPayloadError("400, message:\n  Can not decode content-encoding: gzip")
    payload.__cause__ = ContentEncodingError("Can not decode content-encoding: gzip")
    assert malformed.reason(payload) == "Can not decode content-encoding: gzip"


class StubHandler:
    """What `RequestHandler.log_exception` reads of its handler."""

    logger = logging.getLogger("aiohttp.server")
    transport = None


def test_a_server_error_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    quiet_malformed_requests()
    caplog.set_level(logging.INFO)
    try:
        raise RuntimeError("a bug")
    except RuntimeError as bug:
        RequestHandler.log_exception(StubHandler(), "Unhandled exception", exc_info=bug)  # type: ignore[arg-type]
    (record,) = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.ERROR and record.exc_info is not None and record.exc_info[0] is RuntimeError


# --- through aiohttp's own parser ---------------------------------------------------------------------------------


async def echo(request: web.Request) -> web.Response:
    return web.json_response({"read": len(await request.read())})


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[int]:
    """An aiohttp server on loopback with the router's error handling: its port."""
    json_protocol_errors()
    quiet_malformed_requests()
    app = web.Application(middlewares=[json_errors_middleware])
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def exchange(port: int, request: bytes) -> bytes:
    """Sends `request` on a new connection and reads until the server closes it (a reset reads as closed)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 30)
    except ConnectionError:
        return b""
    finally:
        writer.close()


MALFORMED = [
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 15\r\n\r\n" + b'{"inputs": "x"}',
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\x00\x02\x13\x01\x01\x00",  # TLS hello
    b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
]


async def test_malformed_requests_through_aiohttp_log_a_few_lines_and_no_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(malformed, "MALFORMED", MalformedRequests())
    caplog.set_level(logging.INFO)
    async with served() as port:
        for _ in range(10):
            for request in MALFORMED:
                answer = await exchange(port, request)
                assert answer == b"" or answer.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400")), answer[:200]
        fine = await exchange(
            port, b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"
        )
        assert fine.startswith(b"HTTP/1.1 200"), fine[:200]
    assert not [r for r in caplog.records if r.exc_info is not None], [r.getMessage() for r in caplog.records]
    assert len(caplog.records) == PER_CLIENT_BURST, [r.getMessage() for r in caplog.records]
    malformed.MALFORMED.summarize()
    (summary,) = lines(caplog, "malformed requests not logged")
    assert summary.count >= 20  # type: ignore[attr-defined]  # the gzip, length and line ones held back
