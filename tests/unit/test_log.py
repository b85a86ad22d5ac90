"""conveyor.log.redact: no credential survives into a log line, whatever its scheme, encoding or the bytes after it.

The lines are what aiohttp and grpc put in their records: a header line quoted by Python's repr (aiohttp's parse
errors), a buffer of several header lines, a headers mapping, grpc's metadata tuples. The key is one this process
does not know (`add_secrets` would catch a known one anyway): the patterns alone must remove it.
"""

from __future__ import annotations

import base64
import logging
import re
import sys

import pytest

from conveyor.log import REDACTED, KeyValueFormatter, redact

KEY = b"sk-userb-0123456789abcdef"  # no process here knows it
BASIC = base64.b64encode(b"u:" + KEY)  # what `Authorization: Basic` carries: the key, base64-encoded


def pieces(secret: bytes, size: int = 8) -> set[bytes]:
    """Every run of `size` bytes of `secret`: a piece of the key is a leak too."""
    return {secret[i : i + size] for i in range(len(secret) - size + 1)}


def decoded_runs(text: bytes) -> list[bytes]:
    """Every run of base64 characters in `text`, decoded at each of its four alignments (a run may start mid-quad)."""
    out = []
    for run in re.findall(rb"[A-Za-z0-9+/]{8,}", text):
        for start in range(4):
            quads = run[start:][: (len(run) - start) // 4 * 4]
            out.append(base64.b64decode(quads))
    return out


def leaks(line: str) -> list[bytes]:
    """The pieces of KEY, raw or base64-decoded, that `line` holds."""
    data = line.encode("utf-8", "backslashreplace")
    found = [p for p in pieces(KEY) | pieces(BASIC) if p in data]
    return found + [p for run in decoded_runs(data) for p in pieces(KEY) if p in run]


CORPUS = {
    # The line of issue 65: a Basic credential followed by a NUL (aiohttp refuses the line and quotes it whole).
    "basic-then-nul": repr(b"Authorization: Basic " + BASIC + b"\x00"),
    "basic-nul-within": repr(b"Authorization: Basic " + BASIC[:6] + b"\x00" + BASIC[6:]),
    "basic-valid": repr(b"Authorization: Basic " + BASIC),
    "bearer-then-nul": repr(b"Authorization: Bearer " + KEY + b"\x00"),
    "bearer-nul-within": repr(b"Authorization: Bearer " + KEY[:3] + b"\x00" + KEY[3:]),
    "bearer-lowercase": repr(b"authorization: bearer " + KEY + b"\x01"),
    "no-scheme": repr(b"Authorization: " + KEY + b"\x01"),
    "unknown-scheme": repr(b"Authorization: Custom " + KEY + b"\x7f"),
    "a-quote-within": repr(b"Authorization: Bearer " + KEY[:5] + b"'\"" + KEY[5:]),
    "non-utf8-within": repr(b"Authorization: Bearer " + KEY[:5] + b"\xe9\xed\xa0\x80" + KEY[5:]),
    "x-api-key-then-nul": repr(b"x-api-key: " + KEY + b"\x00"),
    "x-api-key-nul-within": repr(b"X-Api-Key: " + KEY[:4] + b"\x00" + KEY[4:]),
    "proxy-authorization": repr(b"Proxy-Authorization: Basic " + BASIC + b"\x00"),
    "mangled-header-name-basic": repr(b"Auth\x00orization: Basic " + BASIC),
    "mangled-header-name-bearer": repr(b"Auth\x00orization: Bearer " + KEY),
    "in-a-buffer": repr(b"POST / HTTP/1.1\r\nAuthorization: Basic " + BASIC + b"\x00\r\nHost: x\r\n\r\n"),
    "headers-mapping": str({"Host": "x", "Authorization": "Basic " + BASIC.decode(), "x-api-key": KEY.decode()}),
    "grpc-metadata": str((("authorization", "Bearer " + KEY.decode()), ("x-api-key", KEY.decode()))),
    "a-real-line-break-after": "Authorization: Basic " + BASIC.decode() + "\x00\nnext line",
}


@pytest.mark.parametrize("line", list(CORPUS.values()), ids=list(CORPUS))
def test_no_piece_of_a_key_raw_or_decoded_survives(line: str) -> None:
    assert leaks(line), "the corpus line holds the key to begin with"
    redacted = redact(line)
    assert not leaks(redacted), redacted
    assert REDACTED in redacted


def test_the_scheme_word_and_the_lines_after_a_credential_stay() -> None:
    """The credential goes, to the end of its header line; what kind it was and the other headers stay."""
    line = repr(b"POST / HTTP/1.1\r\nAuthorization: Basic " + BASIC + b"\r\nHost: example\r\n")
    assert redact(line) == r"b'POST / HTTP/1.1\r\nAuthorization: Basic <redacted>\r\nHost: example\r\n'"
    assert redact("Authorization: Bearer abc") == "Authorization: Bearer <redacted>"


def test_a_record_and_its_traceback_are_redacted() -> None:
    """What the formatter writes, exception and all: aiohttp's parse errors quote the header line in the exception."""
    try:
        raise ValueError("Invalid header value char:\n\n  " + CORPUS["basic-then-nul"])
    except ValueError:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", None, None)
        record.exc_info = sys.exc_info()
    line = KeyValueFormatter("router").format(record)
    assert "Traceback" in line and not leaks(line), line
