"""A chat prompt as the model's template renders it, with the spans of text the caller wrote.

A template writes its own special tokens (turn markers, end of text) around each message. If the messages' text
were tokenized with special tokens recognised, a message containing `<|im_end|>` or `</s>` would become real
control tokens: a user's message could close its turn and open a system turn of its own. So the messages' text
is tokenized as plain text (`Validation.input_ids` with these spans), the template's own markers as tokens.

The spans are found by rendering the template with a placeholder for each message's text, then putting the text
back where the placeholders landed. That is done only when some message contains a special token's text: every
other prompt is rendered and tokenized whole, exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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
