"""The loopback guard (tests/loopback.py): loopback passes, anything else is refused before it is sent. The
refusals checked here cannot send anything even if the guard were off: 0.0.0.0 stays on this machine, and a
numeric-only lookup asks no name server."""

from __future__ import annotations

import socket

import loopback
import pytest


def test_loopback_addresses_and_localhost_are_loopback() -> None:
    for host in ("127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1", "localhost", "LocalHost."):
        assert loopback.is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "192.0.2.1", "10.0.0.5", "fd00::2", "fe80::1%eth0", "shard", "example.com"):
        assert not loopback.is_loopback(host), host


def test_only_lookups_that_ask_nobody_pass() -> None:
    for host in (None, "", "127.0.0.1", "::1", "192.0.2.1", "localhost", b"localhost"):
        assert loopback.asks_nobody(host), host
    for host in ("shard", "example.com", b"node-3.example", "foo.localhost"):
        assert not loopback.asks_nobody(host), host


def test_the_guard_holds_in_the_test_process() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for host in ("127.0.0.1", "localhost"):  # a name that resolves to loopback passes
            socket.create_connection((host, port), timeout=10).close()
    first = len(loopback.refused)
    with pytest.raises(loopback.NonLoopbackTraffic):
        socket.create_connection(("0.0.0.0", port), timeout=10)
    with socket.socket() as sock, pytest.raises(loopback.NonLoopbackTraffic):
        sock.connect_ex(("0.0.0.0", port))
    with pytest.raises(loopback.NonLoopbackTraffic):
        socket.getaddrinfo("shard", port, flags=socket.AI_NUMERICHOST)
    assert loopback.refused[first:] == [f"a connection to 0.0.0.0 port {port}"] * 2 + ["a lookup of 'shard'"]
    del loopback.refused[first:]  # refused on purpose: not a failure of this test
