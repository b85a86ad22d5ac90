"""A chat prompt as the model's template renders it, with the spans of text the caller wrote.

A template writes its own special tokens (turn markers, end of text) around each message. If the messages' text
were tokenized with special tokens recognised, a message containing `<|im_end|>` or `</s>` would become real
control tokens: a user's message could close its turn and open a system turn of its own. So the messages' text
is tokenized as plain text (`Validation.input_ids` with these spans), the template's own markers as tokens.

The spans are found by rendering the template with a placeholder for each message's text, then putting the text
back where the placeholders landed. That is done only when some message contains a special token's text: every
other prompt is rendered and tokenized whole, exactly as before.

A request's own template variables (`chat_template_kwargs`) are written by the template as its own text, so they
are held to the same rule, and may not replace what the router or the tokenizer gives the template
(`template_kwargs`).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from conveyor.router.api.base import ValidationError

Span = tuple[int, int]

# Private-use characters no template writes: a placeholder is \ue000<index>\ue001.
_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    plain_spans: tuple[Span, ...] = ()  # character spans of the caller's text, tokenized without special tokens


Render = Callable[[list[dict], "list[dict] | None"], str]


def render_chat(
    render: Render,
    messages: list[dict],
    special_texts: Iterable[str],
    trusted: bool = False,
    tools: list[dict] | None = None,
) -> ChatPrompt:
    """`render` is the template over messages and tools; `special_texts` the tokenizer's special tokens as text.
    Besides messages' content, the caller writes the tools (names, descriptions, parameter schemas) and the
    arguments of past tool calls: a string there holding a special token's text is text too, written where the
    template writes it, raw or as JSON (`tojson`). A trusted deployment (`--chat-special-tokens`) keeps them as
    control tokens wherever they are written."""
    specials = [s for s in special_texts if s]
    texts = [text for m in messages for text in _content_texts(m.get("content"))]
    calls = [c for m in messages for c in m.get("tool_calls") or ()]
    written = [*texts, *_strings(tools or []), *_strings([c.get("function", {}).get("arguments") for c in calls])]
    if trusted or not any(s in text for text in written for s in specials):
        return ChatPrompt(render(messages, tools))
    originals: list[tuple[str, bool]] = []  # each placeholder's text, and whether the template writes it raw
    guarded = [*specials, "\ue000"]  # a string spelling a placeholder itself is put back as text too
    marked = [_marked_message(m, originals, guarded) for m in messages]
    rendered = render(marked, _marked(tools, originals, guarded) if tools is not None else None)
    if "\\ue000" in rendered.lower():
        raise ValidationError("the chat template escapes text it writes: a special token's text cannot be kept text")
    pieces = _PLACEHOLDER.split(rendered)
    text, spans = "", []
    for position, piece in enumerate(pieces):
        if position % 2 == 0:  # the template's own text
            text += piece
            continue
        original, raw = originals[int(piece)]
        if not raw and _quoted(pieces, position):  # inside a JSON string: written as JSON writes it
            original = json.dumps(original, ensure_ascii=False)[1:-1]
        spans.append((len(text), len(text) + len(original)))
        text += original
    return ChatPrompt(text, tuple(spans))


def _content_texts(content: Any) -> list[str]:
    """A message's text: its string content, or its text parts' (an image-text chat's)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _quoted(pieces: list[str], position: int) -> bool:
    """Whether the placeholder at `position` stands between double quotes, as `tojson` writes a string."""
    return pieces[position - 1].endswith('"') and position + 1 < len(pieces) and pieces[position + 1].startswith('"')


def _placeholder(original: str, originals: list[tuple[str, bool]], raw: bool) -> str:
    originals.append((original, raw))
    return f"\ue000{len(originals) - 1}\ue001"


def _marked_message(message: dict, originals: list[tuple[str, bool]], specials: list[str]) -> dict:
    """The message with its content (always) and any of its tool calls' argument strings holding a special
    token's text as placeholders."""
    content = message.get("content")
    if isinstance(content, str):
        message = {**message, "content": _placeholder(content, originals, raw=True)}
    elif isinstance(content, list):
        parts = [
            {**p, "text": _placeholder(p["text"], originals, raw=True)} if isinstance(p.get("text"), str) else p
            for p in content
        ]
        message = {**message, "content": parts}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": _marked(message["tool_calls"], originals, specials)}
    return message


def _marked(value: Any, originals: list[tuple[str, bool]], specials: list[str]) -> Any:
    """`value` (JSON) with each string and key that holds a special token's text as a placeholder; every other
    string stays, so a template's tests on them (a type, a role) see what they always saw."""
    if isinstance(value, str):
        return _placeholder(value, originals, raw=False) if any(s in value for s in specials) else value
    if isinstance(value, dict):
        return {_marked(k, originals, specials): _marked(v, originals, specials) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(item, originals, specials) for item in value]
    return value


# What a template gets from the tokenizer beside the caller's variables: its special tokens by name.
SPECIAL_TOKEN_NAMES = frozenset(
    ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
)
# What the router passes apply_chat_template (which passes it on to its renderer, under these names too).
ALWAYS_RESERVED = frozenset(
    (
        "messages",
        "conversation",
        "conversations",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "return_assistant_tokens_mask",
        "tokenize",
    )
)


def template_kwargs(
    kwargs: dict[str, Any], tokenizer: Any, special_texts: Iterable[str], trusted: bool = False
) -> dict[str, Any]:
    """A request's `chat_template_kwargs`, checked: none may set what the router passes the template itself (the
    messages, tools, generation prompt...) or what the tokenizer gives it (its special tokens); and, unless the
    deployment trusts its callers (`--chat-special-tokens`), no value may hold a special token's text: a template
    writes its variables as its own text, where that text would be a control token."""
    clash = sorted(set(kwargs) & _reserved(tokenizer))
    if clash:
        names = ", ".join(f"`{name}`" for name in clash)
        raise ValidationError(f"`chat_template_kwargs` may not set {names}: the router sets it for the template")
    specials = [s for s in special_texts if s]
    if not trusted and any(s in text for text in _strings(kwargs) for s in specials):
        raise ValidationError("`chat_template_kwargs` may not hold a special token's text")
    return kwargs


def _reserved(tokenizer: Any) -> set[str]:
    """apply_chat_template's own arguments and the special tokens' names."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    own = set(inspect.signature(apply).parameters) - {"kwargs", "self"} if apply is not None else set()
    specials = set(getattr(tokenizer, "special_tokens_map", {}) or {})
    specials |= set(getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()))
    return own | specials | SPECIAL_TOKEN_NAMES | ALWAYS_RESERVED


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (iteratively: a value may be nested deep)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
