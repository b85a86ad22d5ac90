"""The rule image URL fetching follows (router/pipeline/image_urls.py): which hosts and addresses
--image-url-allowed-hosts lets the router reach, and that fetching off refuses by the flag's name. Fetching itself
is tested end to end against a loopback server (tests/e2e/test_images.py)."""

from __future__ import annotations

import ipaddress

import pytest

from conveyor.router.api.base import ValidationError
from conveyor.router.pipeline.image_urls import AllowedHosts, ImageUrls


def test_hosts_are_allowed_by_name_domain_address_or_any() -> None:
    allowed = AllowedHosts.parse("images.example.com, .cdn.example.org,203.0.113.7,10.1.0.0/16")
    assert allowed.host_allowed("images.example.com") and allowed.host_allowed("IMAGES.example.com.".lower())
    assert allowed.host_allowed("cdn.example.org") and allowed.host_allowed("a.b.cdn.example.org")
    assert not allowed.host_allowed("evilcdn.example.org") and not allowed.host_allowed("example.com")
    assert allowed.host_allowed("203.0.113.7") and allowed.host_allowed("10.1.2.3")
    assert not allowed.host_allowed("10.2.0.1") and not allowed.host_allowed("localhost")
    assert AllowedHosts.parse("*").host_allowed("anything.example")
    assert not AllowedHosts.parse(None).host_allowed("example.com")


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.0.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "::1", "fd00::1", "::ffff:127.0.0.1"],
)
def test_an_inner_address_is_reached_only_where_the_list_names_it(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert not AllowedHosts.parse("*").address_allowed(ip)
    assert not AllowedHosts.parse("images.example.com").address_allowed(ip)
    written = str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else address
    assert AllowedHosts.parse(written).address_allowed(ip)


def test_a_public_address_is_reached() -> None:
    assert AllowedHosts.parse("*").address_allowed(ipaddress.ip_address("93.184.216.34"))


def test_urls_are_refused_by_the_flag_that_refuses_them() -> None:
    with pytest.raises(ValidationError, match="--image-url-fetch"):
        ImageUrls(False, "*", 1.0, 100).fetch_all(["https://example.com/cat.png"])
    urls = ImageUrls(True, "127.0.0.1", 1.0, 100, loop=object())  # refused before any fetch: no loop is used
    for url, named in [
        ("http://localhost/cat.png", "--image-url-allowed-hosts"),
        ("ftp://127.0.0.1/cat.png", "http(s)"),
        ("http://user:pw@127.0.0.1/cat.png", "credentials"),
        ("http://127.0.0.2/cat.png", "--image-url-allowed-hosts"),
    ]:
        with pytest.raises(ValidationError, match=named.replace("(", r"\(").replace(")", r"\)")):
            urls.fetch_all([url])
