"""One logging set-up for every Conveyor process: structured key=value lines, quiet (WARNING) by default."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable

# One character of a credential as it reaches a log line: a byte as Python's repr quotes it (aiohttp's parse errors
# quote the raw header line; a quoted NUL, `\x00`, once ended the match and left the rest of the key in the log), or
# any other character but a line break (a real one, or a quoted `\r` or `\n`).
_ESCAPED = r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|[^rn])"
# A header that carries a credential: its name, its separator (`Authorization: `, `'authorization': '`, a grpc
# metadata tuple's `', '`) and the scheme word if it is a known one (kept: it tells what kind was sent). All that
# follows, to the end of the line or of the quoted line, is the credential, whatever bytes it holds: a `Basic`
# credential is base64 of `user:key`, and redacting only a word after `Bearer` let a key through encoded.
_CREDENTIAL_HEADER = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?|['\"]\s*,\s*['\"])"
    r"((?:basic|bearer|digest|negotiate|ntlm|token)\s+)?"
    rf"(?:{_ESCAPED}|[^\r\n\\])+"
)
# A credential after its scheme word where no header name comes before it (a header name with a NUL in it).
_SCHEME = re.compile(rf"(?i)\b((?:bearer|basic)\s+)(?:{_ESCAPED}|[^\s'\"\\])+")
_SECRETS: set[str] = set()  # the API keys this process knows: never written out, wherever they turn up
REDACTED = "<redacted>"


def add_secrets(secrets: Iterable[str | None]) -> None:
    """Strings that no log line of this process may contain (the router's API keys)."""
    _SECRETS.update(s for s in secrets if s)


def redact(text: str) -> str:
    """`text` without any credential (an `Authorization` or `X-Api-Key` header's value, a `Bearer` or `Basic`
    one) or known secret: what every log line goes through, aiohttp's and grpc's own records and their tracebacks
    included."""
    text = _CREDENTIAL_HEADER.sub(lambda m: f"{m[1]}{m[2]}{m[3] or ''}{REDACTED}", text)
    text = _SCHEME.sub(rf"\1{REDACTED}", text)
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=... proc=... logger=... msg="..."` plus any `extra=` fields, one line per record."""

    _STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "proc": self.process_name,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields.update({k: v for k, v in vars(record).items() if k not in self._STANDARD})
        line = " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return redact(line)


def _quote(value: object) -> str:
    text = str(value)
    return f'"{text}"' if (" " in text or "=" in text or not text) else text


def setup(process_name: str, level: str | None = None) -> None:
    """Configures the root logger; the level comes from the argument, else CONVEYOR_LOG_LEVEL, else WARNING."""
    level = (level or os.environ.get("CONVEYOR_LOG_LEVEL") or "WARNING").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(process_name))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
