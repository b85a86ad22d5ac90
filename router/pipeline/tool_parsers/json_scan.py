"""Where a JSON value ends, found as its text arrives: a call's arguments stream while they are written, so the
reader must know, a character at a time, whether the value is still open. Only strings and nesting are followed;
the value is checked whole with `json.loads` once it has ended."""

from __future__ import annotations

CLOSING = {"{": "}", "[": "]"}


class ValueScanner:
    """Follows one JSON object, array or string from its first character. `end` is set (an index into the text
    fed, counted from the first character) once the value is complete; `broken` once it cannot be JSON (a closer
    that does not match, a value that does not start as one of these)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.in_string = False
        self.escape = False
        self.seen = 0  # characters consumed
        self.end: int | None = None
        self.broken = False

    @property
    def done(self) -> bool:
        return self.end is not None or self.broken

    def feed(self, text: str) -> None:
        for char in text:
            if self.done:
                return
            self._char(char)
            self.seen += 1

    def _char(self, char: str) -> None:
        if self.seen == 0:
            self._first(char)
        elif self.in_string:
            self._string_char(char)
        elif char == '"':
            self.in_string = True
        elif char in CLOSING:
            self.stack.append(CLOSING[char])
        elif char in "}]":
            self._close(char)

    def _first(self, char: str) -> None:
        if char == '"':
            self.in_string = True
        elif char in CLOSING:
            self.stack.append(CLOSING[char])
        else:
            self.broken = True

    def _string_char(self, char: str) -> None:
        if self.escape:
            self.escape = False
        elif char == "\\":
            self.escape = True
        elif char == '"':
            self.in_string = False
            if not self.stack:  # a top-level string
                self.end = self.seen + 1

    def _close(self, char: str) -> None:
        if not self.stack or self.stack.pop() != char:
            self.broken = True
        elif not self.stack:
            self.end = self.seen + 1
