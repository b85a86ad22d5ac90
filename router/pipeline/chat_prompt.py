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


def render_chat(
    render: Callable[[list[dict]], str], messages: list[dict], special_texts: Iterable[str], trusted: bool = False
) -> ChatPrompt:
    """`render` is the template over messages; `special_texts` the tokenizer's special tokens as text. A trusted
    deployment (`--chat-special-tokens`) keeps them as control tokens wherever they are written."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    specials = [s for s in special_texts if s]
    if trusted or not any(s in text for text in texts for s in specials):
        return ChatPrompt(render(messages))
    marked, index = [], 0
    for message in messages:
        if isinstance(message.get("content"), str):
            message = {**message, "content": f"\ue000{index}\ue001"}
            index += 1
        marked.append(message)
    pieces = _PLACEHOLDER.split(render(marked))
    text, spans = "", []
    for position, piece in enumerate(pieces):
        if position % 2 == 0:  # the template's own text
            text += piece
        else:
            content = texts[int(piece)]
            spans.append((len(text), len(text) + len(content)))
            text += content
    return ChatPrompt(text, tuple(spans))


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
