"""Images a client names by http(s) URL, fetched by the router where `--image-url-fetch` allows it.

Off by default: a URL is then refused by name (send the image as a data URL). On, a URL is fetched only from a
host `--image-url-allowed-hosts` names, and the rule against server-side request forgery (a tenant making the
router reach an internal service) is:

- a host is allowed if the list names it (`images.example.com`), a domain above it (`.example.com`: the domain
  and every name under it), `*` (any host), or, for an IP address written in the URL, that address or a network
  holding it (`203.0.113.7`, `10.1.0.0/16`);
- every address the host resolves to must be public (global unicast), unless the list names that address or a
  network holding it: a loopback, private, link-local (cloud metadata), shared, multicast or reserved address is
  reached only when the operator wrote it down, never through a name (so a DNS answer that points an allowed name
  at 127.0.0.1 or 169.254.169.254 is refused), and the connection is made to the addresses checked, not to a
  second lookup's;
- redirects are followed by hand, at most MAX_REDIRECTS, each new URL checked as the first was: a redirect never
  leads off the list;
- the answer must be `200`, its `Content-Type` `image/*`, its body at most `--max-image-bytes` (read no further),
  and every image of the request must arrive within `--image-url-timeout` seconds in all;
- no proxy from the environment is used, and no cookies are kept.

The fetches run on the event loop (aiohttp, which the router serves with), all of a request's at once; the
validation worker that reads the request waits for them, at most the timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from conveyor.router.api.base import ValidationError

MAX_REDIRECTS = 3
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Refused(OSError):
    """An address the rule does not let the router reach (raised by the resolver, so that aiohttp connects only to
    addresses that passed)."""


@dataclass(frozen=True)
class AllowedHosts:
    """`--image-url-allowed-hosts`, read: names, domains, any host, and the networks written out."""

    names: frozenset[str] = frozenset()
    domains: tuple[str, ...] = ()  # ".example.com"
    networks: tuple[_Network, ...] = ()
    any_host: bool = False

    @classmethod
    def parse(cls, text: str | None) -> AllowedHosts:
        names, domains, networks, any_host = set(), [], [], False
        for entry in (e.strip().lower() for e in (text or "").split(",")):
            if not entry:
                continue
            if entry == "*":
                any_host = True
            elif entry.startswith("."):
                domains.append(entry)
            else:
                try:
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                except ValueError:
                    names.add(entry.rstrip("."))
        return cls(frozenset(names), tuple(domains), tuple(networks), any_host)

    def host_allowed(self, host: str) -> bool:
        """Whether the URL's host is on the list (its addresses are checked apart, by `address_allowed`)."""
        address = _address(host)
        if address is not None:
            return self.any_host or self.named(address)
        host = host.rstrip(".")
        return self.any_host or host in self.names or any(f".{host}".endswith(d) for d in self.domains)

    def named(self, address: _Address) -> bool:
        return any(address in network for network in self.networks)

    def address_allowed(self, address: _Address) -> bool:
        """A public address; any other only where the list names it (or a network holding it)."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return self.named(address) or (address.is_global and not address.is_multicast)


class _CheckedResolver(AbstractResolver):
    """The system's resolver, whose every answer must pass the rule: aiohttp connects to what this returns."""

    def __init__(self, allowed: AllowedHosts) -> None:
        self.allowed = allowed
        self.inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        results: list[ResolveResult] = await self.inner.resolve(host, port, family)
        for result in results:
            address = ipaddress.ip_address(result["host"].split("%")[0])
            if not self.allowed.address_allowed(address):
                raise Refused(
                    f"image URL host {host!r} resolves to {address}, which is not a public address and not named "
                    "in --image-url-allowed-hosts"
                )
        return results

    async def close(self) -> None:
        await self.inner.close()


def _address(host: str) -> _Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None


class ImageUrls:
    """Fetches a request's image URLs under the flags; `fetch_all` is called from a validation worker thread."""

    def __init__(
        self,
        enabled: bool,
        allowed_hosts: str | None,
        timeout: float,
        max_bytes: int,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.enabled = enabled
        self.allowed = AllowedHosts.parse(allowed_hosts)
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.loop = loop

    def fetch_all(self, urls: Iterable[str]) -> list[bytes]:
        """Each URL's image bytes, in order; ValidationError naming the flag or limit that refused one."""
        urls = list(urls)
        if not self.enabled or self.loop is None:
            raise ValidationError(
                "image URLs are not fetched on this server (--image-url-fetch is off): send the image as a base64 "
                "data URL"
            )
        for url in urls:
            self._check(url)
        future = asyncio.run_coroutine_threadsafe(self._fetch_all(urls), self.loop)
        try:
            return future.result(self.timeout + 5)  # the coroutine ends itself at the timeout; this is a backstop
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            future.cancel()
            raise self._late() from None

    def _late(self) -> ValidationError:
        return ValidationError(f"the image URLs did not answer within {self.timeout:g} s (--image-url-timeout)")

    def _check(self, url: str) -> None:
        """A URL's scheme and host against the list (its addresses are checked as it is resolved)."""
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            parts.port  # noqa: B018 - raises ValueError for a malformed port
        except ValueError:
            raise ValidationError("an image URL is malformed") from None
        if parts.scheme not in ("http", "https") or not host:
            raise ValidationError("an image URL must be http(s)://HOST/...")
        if parts.username is not None or parts.password is not None:
            raise ValidationError("an image URL may not carry credentials")
        if not self.allowed.host_allowed(host):
            raise ValidationError(f"image URL host {host!r} is not in --image-url-allowed-hosts")
        address = _address(host)
        if address is not None and not self.allowed.address_allowed(address):
            raise ValidationError(
                f"image URL address {address} is not a public address and not named in --image-url-allowed-hosts"
            )

    async def _fetch_all(self, urls: list[str]) -> list[bytes]:
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self.allowed), limit=len(urls) or 1)
        async with aiohttp.ClientSession(
            connector=connector, trust_env=False, cookie_jar=aiohttp.DummyCookieJar()
        ) as session:
            fetches = asyncio.gather(*(self._fetch(session, url) for url in urls))
            try:  # wait_for, not asyncio.timeout: the router runs on Python 3.10 too
                return list(await asyncio.wait_for(fetches, self.timeout))
            except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on, not before
                raise self._late() from None

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                async with session.get(url, allow_redirects=False, headers={"Accept": "image/*"}) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        location = response.headers.get("Location")
                        if not location:
                            raise ValidationError(f"an image URL answered a redirect ({response.status}) to nowhere")
                        url = urljoin(url, location)
                        self._check(url)
                        continue
                    return await self._body(response)
            except ValidationError:
                raise
            except aiohttp.ClientConnectorError as exc:
                if isinstance(exc.os_error, Refused):
                    raise ValidationError(str(exc.os_error)) from None
                raise ValidationError(f"an image URL could not be fetched: {exc}") from None
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                raise ValidationError(f"an image URL could not be fetched: {exc}") from None
        raise ValidationError(f"an image URL redirected more than {MAX_REDIRECTS} times")

    async def _body(self, response: Any) -> bytes:
        if response.status != 200:
            raise ValidationError(f"an image URL answered HTTP {response.status}")
        kind = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if not kind.startswith("image/"):
            raise ValidationError(f"an image URL answered {kind or 'no Content-Type'}, not an image (image/*)")
        too_large = ValidationError(f"an image is larger than {self.max_bytes} bytes (--max-image-bytes)")
        if response.content_length is not None and response.content_length > self.max_bytes:
            raise too_large
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > self.max_bytes:
                raise too_large
        return bytes(body)
