"""One logging set-up for every Conveyor process: structured key=value lines, quiet (WARNING) by default."""

from __future__ import annotations

import logging
import os
import sys


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
        return line


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
