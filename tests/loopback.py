"""Tests send traffic to loopback only (127.0.0.0/8 and ::1): the guard that holds the test process to it.

That is the rule of the machines this project runs on, for the tests, the benchmarks and the soak alike; the one
exception, a host inside a network namespace the test itself creates, no test needs yet (such a test would lift
the guard around that traffic). The guard wraps the socket calls everything in Python connects and resolves
through: `socket.socket.connect` and `connect_ex` (so `socket.create_connection`, httpx, requests, aiohttp and
asyncio too) and `socket.getaddrinfo`. A connection to another address, or a lookup of a name other than
localhost (a DNS query leaves the machine), is refused before anything is sent, and recorded, so that the test
fails even when a library swallows the refusal. A name such as `localhost` passes, and so does what it
resolves to (127.0.0.1, ::1); Unix sockets are not network traffic.

It covers the pytest process only. The servers a test starts are child processes it does not reach: the tests
give them loopback addresses (`127.0.0.1` in --listen, --shard-address, the launcher's default --hostname and
--master-addr), and gRPC's C core, which resolves and connects without Python, is only ever given them too.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest


class NonLoopbackTraffic(RuntimeError):
    """Not an OSError: libraries retry or fall back on those, where this must stop the test at once."""


refused: list[str] = []  # every refusal of the session, in order, for the per-test check in conftest.py


def is_loopback(host: str) -> bool:
    """Whether a connection to this host stays on loopback: a loopback address, or localhost (socket.connect
    resolves a name itself). 0.0.0.0, :: and "" reach this machine too on Linux, but as targets they are
    mistakes: they are what a server binds."""
    try:
        return ip(host).is_loopback
    except ValueError:
        return _is_localhost(host)


def ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IP address, an IPv4-mapped one (::ffff:127.0.0.1, as a dual-stack socket shows an IPv4 address) as
    IPv4; ValueError if `host` is not an address."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def asks_nobody(host: str | bytes | None) -> bool:
    """Whether looking this host up sends nothing: no host (a bind), an IP address, or localhost (/etc/hosts)."""
    if host is None:
        return True
    name = host.decode() if isinstance(host, bytes) else host
    if name == "" or _is_localhost(name):
        return True
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _is_localhost(name: str) -> bool:
    return name.lower().rstrip(".") == "localhost"


def _refuse(what: str) -> NonLoopbackTraffic:
    refused.append(what)
    return NonLoopbackTraffic(f"{what}: tests send traffic to loopback only (127.0.0.0/8, ::1); see tests/loopback.py")


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wraps the socket calls for as long as `monkeypatch` is not undone."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_loopback(str(address[0])):
            raise _refuse(f"a connection to {address[0]} port {address[1]}")

    def guarded_connect(self: socket.socket, address: Any) -> None:
        check(self, address)
        return connect(self, address)

    def guarded_connect_ex(self: socket.socket, address: Any) -> int:
        check(self, address)
        return connect_ex(self, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> list:
        if not asks_nobody(host):
            raise _refuse(f"a lookup of {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
