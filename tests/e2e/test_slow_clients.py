"""Clients that hold connections without sending work, through the real processes (issue "Safe to share"):
slow headers, a slow body, `Expect: 100-continue` with a huge Content-Length, and too many connections from one
address. One deployment with short limits, so that each test is over in seconds."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Server, StreamWatcher, read_answer_until_closed, read_until_closed, start_server, wait_for

IDLE_TIMEOUT, BODY_TIMEOUT, PER_CLIENT = 2, 2, 4
# A test's bound: the limits plus a wide margin for a loaded machine (the connection used to stay open for ever).
DEADLINE = 60


@pytest.fixture(scope="module")
def log_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("log") / "deployment.log"


@pytest.fixture(scope="module")
def server(tiny_model: Path, log_file: Path) -> Iterator[Server]:
    server = start_server(
        tiny_model,
        "--http-idle-timeout",
        str(IDLE_TIMEOUT),
        "--http-body-timeout",
        str(BODY_TIMEOUT),
        "--max-connections-per-client",
        str(PER_CLIENT),
        env={"CONVEYOR_LOG_LEVEL": "INFO"},
        log=log_file,
    )
    yield server
    assert server.stop() == 0


def connect(server: Server) -> socket.socket:
    return server.raw_connection(timeout=DEADLINE)


def test_headers_that_never_end_are_cut_off(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")  # and nothing more
        assert read_until_closed(connection) == b""  # closed by the server, unanswered, within the socket's DEADLINE


@pytest.mark.parametrize(
    ("length", "status", "error_type"),
    [(100, b"408", "timeout"), (50_000_000, b"413", "payload_too_large")],
    ids=["slower-than-its-length", "over-the-payload-limit"],
)
def test_a_body_that_will_not_come_whole_is_refused(server: Server, length: int, status: bytes, error_type: str):
    """A body slower than its length gets 408 at the body timeout; one announced over the payload limit 413 on its
    headers, without `Expect` too (before, that one too was held until the body timeout and answered 408)."""
    with connect(server) as connection:
        connection.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{" % length
        )
        answer = read_answer_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error_type"] == error_type


def test_expect_continue_over_the_payload_limit_gets_413_not_100(server: Server) -> None:
    with connect(server) as connection:
        connection.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\nExpect: 100-continue\r\n\r\n"
        )
        answer = read_answer_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"100 Continue" not in answer
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
    small = httpx.post(f"{server.url}/generate", json=body, headers={"Expect": "100-continue"}, timeout=60)
    assert small.status_code == 200, small.text  # within the limit, the usual 100 Continue and an answer


def test_a_client_that_resets_mid_body_leaves_one_quiet_line(server: Server, log_file: Path) -> None:
    """Not an unhandled-error traceback: a client hanging up is no fault of the server's."""
    with connect(server) as connection:
        connection.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    said = ("client reset the connection before its body arrived", "Error handling request")
    wait_for(lambda: any(line in log_file.read_text() for line in said), DEADLINE, "the router to notice")
    assert said[1] not in log_file.read_text() and "Traceback" not in log_file.read_text()


def test_one_address_holds_at_most_its_cap_of_connections(server: Server) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
    streams = [StreamWatcher(server, body).start() for _ in range(PER_CLIENT)]  # each holds a busy connection
    try:
        wait_for(lambda: all(s.events for s in streams), 120, "the streams to start")
        with connect(server) as connection:
            connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            try:
                assert read_until_closed(connection) == b""  # one too many: closed at once, unanswered
            except ConnectionResetError:
                pass  # ...or reset, the request unread
    finally:
        for stream in streams:
            stream.hang_up.set()
    wait_for(lambda: healthy(server), 60, "room for a connection again")


def healthy(server: Server) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    except httpx.TransportError:  # closed at once: the streams' connections are not all gone yet
        return False
