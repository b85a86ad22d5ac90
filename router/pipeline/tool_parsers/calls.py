"""The one machine that reads tool calls out of an answer, for every family: each family only says how it frames
its calls (`Framing`). It reads text as it arrives and gives `ChatDelta`s in order: content until a call opens, then
the call (its name as soon as it is known and one of the tools, then its arguments in pieces as they are written),
then content again.

A call is a JSON object `{"name": ..., "arguments": {...}}` (`"parameters"` is taken for `"arguments"`, as Llama
writes it). What does not read as a call, whose name is not among the tools, or is cut short, is content, with
the family's marker: nothing is lost and nothing is an error. The content is the text outside the calls; the
whitespace between it and a call stays between two pieces of content, and is dropped at the content's ends.

Whole (the text with `final`) and streamed, the reading is the same, with one exception a stream cannot
avoid: a call whose name was sent and whose JSON then breaks off (malformed, or cut by the token limit) keeps what
was sent, and the text after it streams as content; read whole, that call is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.router.pipeline.deltas import ChatDelta
from conveyor.router.pipeline.tool_parsers.json_scan import ValueScanner
from conveyor.router.pipeline.tools import ToolUse

# The start of a call whose name comes first (as every family writes it): enough to name it before its arguments.
HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass(frozen=True)
class Framing:
    """How a family writes its calls in an answer."""

    opens: tuple[str, ...] = ()  # markers that open calls anywhere in the answer
    at_start: str = ""  # a character that opens calls when the answer starts with it ("{": Llama's bare JSON)
    bare_separator: str | None = None  # calls outside a JSON list: between them ("": one per opener); None: a list
    closes: tuple[str, ...] = ()  # a marker after the calls (optional: a model may stop without it)


@dataclass
class _Call:
    """The call object being read: from its `{` at `start` in the answer."""

    start: int
    index: int
    scanner: ValueScanner
    args_at: int | None = None  # where its arguments' `{` is, once the header is read
    args: ValueScanner | None = None
    sent: int = 0  # where in the answer the arguments sent so far end
    call_id: str | None = None  # set once its first piece was sent


class CallReader:
    """One choice's answer in `framing`, calls to `tools` only; `new_id` makes a call's id (a family's rule)."""

    def __init__(self, tools: ToolUse, framing: Framing, new_id: Callable[[], str]) -> None:
        self.names = {t.name for t in tools.tools}
        self.framing = framing
        self.new_id = new_id
        self.text = ""
        self.pos = 0  # the text before it is read
        self.state = "content"  # content | open | item | object | after | close
        self.listed = False  # the calls of this section are in a JSON list
        self.started = False  # the answer has begun (so `at_start` no longer applies)
        self.held = ""  # whitespace beside a call: content only if more content follows
        self.content_sent = False
        self.section_start = self.opener_end = 0  # where the section's opener starts and ends
        self.section_calls = 0
        self.calls = 0
        self.call: _Call | None = None
        self.out: list[ChatDelta] = []

    def feed(self, text: str, final: bool = False) -> list[ChatDelta]:
        """The pieces `text` completes; `final`: the answer ends here, so what is unfinished is not a call."""
        self.text += text
        return self._run(final)

    # --- the machine ----------------------------------------------------------------------------------------

    def _run(self, final: bool) -> list[ChatDelta]:
        steps = {
            "content": self._content,
            "open": self._open,
            "item": self._item,
            "object": self._object,
            "after": self._after,
            "close": self._close,
        }
        while steps[self.state](final):
            pass
        out, self.out = self.out, []
        return out

    def _emit_content(self, text: str) -> None:
        """Sends content, after the whitespace held beside a call; at the content's start after a call, without
        the whitespace."""
        if not text:
            return
        text, self.held = self.held + text, ""
        if self.calls and not self.content_sent:
            text = text.lstrip()
        if text:
            self.out.append(ChatDelta(content=text))
            self.content_sent = True

    def _space(self) -> str:
        """The whitespace at the reading position (not consumed)."""
        rest = self.text[self.pos :]
        return rest[: len(rest) - len(rest.lstrip())]

    def _skip_space(self) -> str | None:
        """The next character after whitespace (consumed), or None if only whitespace has come yet."""
        rest = self.text[self.pos :]
        stripped = rest.lstrip()
        self.pos += len(rest) - len(stripped)
        return stripped[0] if stripped else None

    # --- content --------------------------------------------------------------------------------------------

    def _content(self, final: bool) -> bool:
        if not self.started and self.framing.at_start:
            start = self._answer_start()
            if start is None and not final:
                return False
            self.started = start is not None
            if start is not None and self.text[start] == self.framing.at_start:
                return self._open_section(start, start)
        found = self._find_opener()
        if found is not None:
            at, opener = found
            return self._open_section(at, at + len(opener))
        end = self._safe_end(final)
        self._emit_content(self.text[self.pos : end])
        self.pos = max(self.pos, end)
        return False

    def _answer_start(self) -> int | None:
        """Where the answer's first character past whitespace is, if it has come."""
        rest = self.text[self.pos :]
        stripped = rest.lstrip()
        return self.pos + len(rest) - len(stripped) if stripped else None

    def _find_opener(self) -> tuple[int, str] | None:
        hits = [(self.text.find(o, self.pos), o) for o in self.framing.opens]
        hits = [(at, o) for at, o in hits if at >= 0]
        return min(hits) if hits else None

    def _safe_end(self, final: bool) -> int:
        """Where the content that can be sent now ends: not within what may be the start of a marker, nor within
        trailing whitespace (dropped if a call follows), until the answer is complete."""
        if final:
            return len(self.text) if not self.calls else self.pos + len(self.text[self.pos :].rstrip())
        end = len(self.text)
        for opener in self.framing.opens:
            for keep in range(min(len(opener) - 1, end - self.pos), 0, -1):
                if opener.startswith(self.text[end - keep :]):
                    end -= keep
                    break
        return self.pos + len(self.text[self.pos : end].rstrip())

    def _open_section(self, at: int, opener_end: int) -> bool:
        """Calls open at `at` (their marker ends at `opener_end`): the whitespace before them is held."""
        before = self.text[self.pos : at]
        self._emit_content(before.rstrip())
        self.held += before[len(before.rstrip()) :]
        self.section_start, self.pos, self.opener_end = at, opener_end, opener_end
        self.section_calls = 0
        self.state = "open"
        self.started = True
        return True

    # --- a section of calls ---------------------------------------------------------------------------------

    def _open(self, final: bool) -> bool:
        first = self._skip_space()
        if first is None:
            return self._break() if final else False
        if first == "[":
            self.listed, self.state = True, "item"
            self.pos += 1
            return True
        if first == "{" and self.framing.bare_separator is not None:
            self.listed = False
            return self._start_call()
        return self._break()

    def _item(self, final: bool) -> bool:
        """Where a call must come (a list's first item, or after a separator); a list may also close."""
        first = self._skip_space()
        if first is None:
            return self._break() if final else False
        if first == "{":
            return self._start_call()
        if first == "]" and self.listed:
            self.pos += 1
            self.state = "close"
            return True
        return self._break()

    def _after(self, final: bool) -> bool:
        """After a call: the next one, the list's end, or (outside a list) the section's end."""
        space = self._space()
        if self.pos + len(space) == len(self.text):
            self.state = "close" if final else self.state
            return final
        first = self.text[self.pos + len(space)]
        separator = "," if self.listed else self.framing.bare_separator
        if separator and first == separator:
            self.pos += len(space) + 1
            self.state = "item"
            return True
        if self.listed:
            if first != "]":
                self.pos += len(space)
                return self._break()
            self.pos += len(space) + 1
        self.state = "close"
        return True

    def _close(self, final: bool) -> bool:
        """The section's optional closing marker (the whitespace before it is the section's); then content again,
        from the whitespace after the calls."""
        space = self._space()
        rest = self.text[self.pos + len(space) :]
        if not rest and not final:
            return False
        closer = next((c for c in self.framing.closes if rest.startswith(c)), None)
        if closer is None and not final and any(c.startswith(rest) for c in self.framing.closes):
            return False
        if closer is not None:
            self.pos += len(space) + len(closer)
        self.state = "content"
        return True

    def _break(self) -> bool:
        """What was read as the start of calls is not one: content again. The text not given to any call (the
        marker and the whitespace before it, if no call came) is content; a call this stream has begun stays."""
        call = self.call
        if call is not None and call.call_id is not None:
            self.pos = call.sent
        elif self.section_calls == 0:
            self._emit_content(self.text[self.section_start : self.opener_end])
            self.pos = self.opener_end
        elif call is not None:
            self.pos = call.start
        self.call, self.state = None, "content"
        return True

    # --- one call -------------------------------------------------------------------------------------------

    def _start_call(self) -> bool:
        self.call = _Call(self.pos, self.calls, ValueScanner())
        self.state = "object"
        return True

    def _object(self, final: bool) -> bool:
        call = self.call
        assert call is not None
        call.scanner.feed(self.text[call.start + call.scanner.seen :])
        if call.scanner.broken:
            return self._break()
        if call.scanner.end is not None:
            return self._end_call(call, self.text[call.start : call.start + call.scanner.end])
        if final:
            return self._break()
        if call.call_id is None:
            header = HEADER.match(self.text, call.start)
            if header is None:
                return False
            name = _string(header.group(1))
            if name not in self.names:
                return self._break()
            self._announce(call, name, header.end())
        self._send_arguments(call, len(self.text))
        return False

    def _announce(self, call: _Call, name: str, args_at: int) -> None:
        """Sends the call's first piece: its header named one of the tools, and its arguments start at
        `args_at`."""
        call.call_id = self.new_id()
        call.args_at = call.sent = args_at
        call.args = ValueScanner()
        self.out.append(ChatDelta(call_index=call.index, call_id=call.call_id, call_name=name))

    def _send_arguments(self, call: _Call, upto: int) -> None:
        assert call.args is not None and call.args_at is not None
        call.args.feed(self.text[call.args_at + call.args.seen : upto])
        end = min(upto, call.args_at + call.args.end) if call.args.end is not None else upto
        if end > call.sent:
            self.out.append(ChatDelta(call_index=call.index, arguments=self.text[call.sent : end]))
            call.sent = end

    def _end_call(self, call: _Call, text: str) -> bool:
        """The call's object is complete: a call if it reads as one, else content (or, if this stream has begun
        it, the call as sent)."""
        read = _read_call(text, self.names)
        if read is None:
            return self._break()
        name, arguments = read
        if call.call_id is None:
            call.call_id = self.new_id()
            self.out.append(ChatDelta(call_index=call.index, call_id=call.call_id, call_name=name, arguments=arguments))
        else:
            self._send_arguments(call, call.start + len(text))
        self.calls += 1
        self.section_calls += 1
        self.pos = call.start + len(text)
        self.call, self.state = None, "after"
        return True


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _read_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """A complete call object's name and arguments (as written, when the name comes first; else as JSON text
    written again), or None if it is not a call to one of `names`."""
    try:
        call = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    header = HEADER.match(text)
    if header is None:
        return call["name"], json.dumps(arguments, ensure_ascii=False)
    scanner = ValueScanner()
    scanner.feed(text[header.end() :])
    assert scanner.end is not None  # the arguments parsed: their object is complete
    return call["name"], text[header.end() : header.end() + scanner.end]
