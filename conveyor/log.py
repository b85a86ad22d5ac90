"""One logging set-up for every Conveyor process: structured key=value lines, quiet (WARNING) by default."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable

# A credential in a header line that something quoted (aiohttp's parse errors quote the raw line): the word after
# `Bearer`, whatever the case, escapes included (a quoted NUL, `\x00`, once ended the match and left the rest of the
# key in the log).
_BEARER = re.compile(r"(?i)(bearer\s+)(?:\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|.)|[^\s'\"\\])+")
_SECRETS: set[str] = set()  # the API keys this process knows: never written out, wherever they turn up
REDACTED = "<redacted>"


def add_secrets(secrets: Iterable[str | None]) -> None:
    """Strings that no log line of this process may contain (the router's API keys)."""
    _SECRETS.update(s for s in secrets if s)


def redact(text: str) -> str:
    """`text` without any bearer credential or known secret: what every log line goes through, aiohttp's and
    grpc's own records and their tracebacks included."""
    text = _BEARER.sub(rf"\1{REDACTED}", text)
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
