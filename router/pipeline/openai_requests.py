"""OpenAI's completions and chat completions bodies as validated requests, one per choice: the prompts, the chat
template's rendering with tools and reasoning, the constraint a body or a forced call sets, and `n` seeded choices.

The OpenAI routes call it, and so do the routes that turn another API's body into a chat (the Responses API,
Anthropic's Messages), so every chat-shaped request is rendered and validated one way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from conveyor.grammar import Constraint
from conveyor.router.api.base import ValidationError
from conveyor.router.api.openai import MAX_CHOICES, ChatRequest, CompletionRequest, Message, MessageToolCall
from conveyor.router.pipeline.chat_output import ChatOutput
from conveyor.router.pipeline.chat_prompt import ChatPrompt, render_chat, template_kwargs
from conveyor.router.pipeline.images import ImageReader, Pixels
from conveyor.router.pipeline.reasoning import Reasoning
from conveyor.router.pipeline.request import ValidRequest, from_chat, from_completion
from conveyor.router.pipeline.tools import ToolUse, tool_use
from conveyor.router.pipeline.validation import Validation


@dataclass
class Choice:
    index: int
    request: ValidRequest
    output: ChatOutput | None = None  # a chat choice's reader: its reasoning, content and tool calls


def with_seed(valid: ValidRequest, index: int) -> ValidRequest:
    """Choice i of a seeded request uses seed + i, so the choices differ but each is reproducible."""
    seed = valid.parameters.seed
    if seed is None or index == 0:
        return valid
    sampling = valid.parameters.sampling.model_copy(update={"seed": (seed + index) % 2**64})
    return replace(valid, parameters=replace(valid.parameters, sampling=sampling))


class OpenAIRequests:
    """Reads bodies against the server's validation (its tokenizer, chat template, parsers and limits)."""

    def __init__(self, validation: Validation) -> None:
        self.validation = validation

    def completion_choices(self, request: CompletionRequest) -> list[Choice]:
        prompts = request.prompts
        if len(prompts) * request.n > MAX_CHOICES:
            raise ValidationError(f"at most {MAX_CHOICES} choices (prompts times `n`) per request")
        choices = []
        for p in prompts:
            valid = self.validation.validate(from_completion(request, p))
            for i in range(request.n):
                choices.append(Choice(len(choices), with_seed(valid, i)))
        return choices

    def chat_choices(self, request: ChatRequest) -> list[Choice]:
        tools = tool_use(request)
        reader = self.validation.images
        pixels = _chat_images(request, reader)
        messages = [_message(m, reader is not None) for m in request.messages]
        prompt = self._render_chat(messages, tools, request.chat_template_kwargs)
        if reader is not None:
            prompt = reader.expand(prompt, pixels)
        parsers = self.validation.parsers
        reasoning = parsers.reasoning_of(prompt.text)
        grammar = _chat_constraint(request, tools, reasoning)
        valid = self.validation.validate(from_chat(request, prompt, grammar))
        if pixels:
            images = reader.place(valid.input_ids, pixels)
            valid = replace(valid, parameters=replace(valid.parameters, images=images))
        return [Choice(i, with_seed(valid, i), parsers.output(tools, reasoning)) for i in range(request.n)]

    def _render_chat(self, messages: list[dict], tools: ToolUse | None, kwargs: dict | None) -> ChatPrompt:
        validation = self.validation
        trusted = validation.chat_special_tokens
        extra = template_kwargs(kwargs, validation.tokenizer, validation.special_texts, trusted) if kwargs else {}

        def render(messages: list[dict], tools: list[dict] | None) -> str:
            with_tools = {"tools": tools} if tools is not None else {}
            return validation.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **extra, **with_tools
            )

        specs = tools.template_tools() if tools is not None else None
        try:
            return render_chat(render, messages, validation.special_texts, trusted, specs)
        except ValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages
            raise ValidationError(f"the chat template could not render the messages: {exc}") from None


def _chat_constraint(request: ChatRequest, tools: ToolUse | None, reasoning: Reasoning | None) -> Constraint | None:
    """The body's constraint or the one a forced call implies (not both), on the answer after any reasoning."""
    grammar = request.constraint()
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if grammar is not None:
            raise ValidationError("a `response_format` or other constraint cannot be combined with this `tool_choice`")
        grammar = forced
    return reasoning.constrain(grammar) if reasoning is not None else grammar


def _chat_images(request: ChatRequest, reader: ImageReader | None) -> list[Pixels]:
    """The chat's images in order, decoded and resized (on this validation worker); refused for a text model or
    past MAX_IMAGES."""
    urls = [
        p.image_url.url
        for m in request.messages
        if isinstance(m.content, list)
        for p in m.content
        if p.type == "image_url"
    ]
    if not urls:
        return []
    if reader is None:
        raise ValidationError("this model takes no images: send text only")
    return reader.read_all(urls)


def _message(message: Message, images: bool = False) -> dict[str, Any]:
    """A message as the chat template gets it. An assistant's tool calls carry their arguments as JSON text in
    OpenAI's API; chat templates expect them parsed. Content parts: for an image-text model, as its processor's
    template takes them (`{"type": "image"}` where an image goes), and string content as one text part (SmolVLM's
    template reads every message's content as parts: it wrote nothing of a string); for a text model, their text
    joined."""
    out = message.model_dump(exclude_unset=True, exclude={"tool_calls"})
    if images and isinstance(message.content, str) and not message.tool_calls:
        out["content"] = [{"type": "text", "text": message.content}]
    if isinstance(message.content, list):
        if images:
            out["content"] = [
                {"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in message.content
            ]
        else:
            out["content"] = "".join(p.text for p in message.content if p.type == "text")
    if message.tool_calls:
        out["content"] = message.content  # null beside calls: templates test for it
        out["tool_calls"] = [_template_call(c) for c in message.tool_calls]
    return out


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # RecursionError: JSON text nested thousands deep
            raise ValidationError("a tool call's `arguments` must be JSON text") from None
    entry = call.model_dump(exclude_unset=True)
    return {**entry, "function": {"name": call.function.name, "arguments": arguments}}
