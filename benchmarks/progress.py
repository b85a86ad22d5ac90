"""Progress on stderr, so that stdout holds only results: a line rewritten in place on a terminal, and a line
at every tenth of the requests otherwise (logs and CI stay short)."""

from __future__ import annotations

import sys
from typing import TextIO


def note(message: str, stream: TextIO | None = None) -> None:
    print(message, file=stream or sys.stderr, flush=True)


class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.live = self.stream.isatty()
        self._next_line = 0  # the `done` count at which a non-terminal stream gets its next line

    def advance(self, success: bool) -> None:
        self.done += 1
        self.failed += not success
        if not self.enabled:
            return
        if self.live:
            self.stream.write(f"\r{self._text()}")
            self.stream.flush()
        elif self.done >= self._next_line or self.done == self.total:
            note(self._text(), self.stream)
            self._next_line = self.done + max(1, self.total // 10)

    def close(self) -> None:
        if self.enabled and self.live:
            self.stream.write("\n")
            self.stream.flush()

    def _text(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        return f"  {self.label}: {self.done}/{self.total} requests done{failed}"
