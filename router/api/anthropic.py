"""Anthropic's Messages API as Conveyor serves it: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request is a chat in another shape: `system` and `messages` (text, `tool_use`, `tool_result` and
`thinking` blocks) become the chat's messages, `tools` and `tool_choice` its function tools (so a forced call goes
through the same grammar as on `/v1/chat/completions`), `max_tokens` and `stop_sequences` its limits. What the API
has and Conveyor does not (images and documents, server tools, MCP servers, containers, prefilled assistant turns)
is refused, by name where the field is known. `cache_control` is taken and ignored: Conveyor's prefix cache keeps
every prompt's blocks without being asked. Answers are the Message object and, when streaming, its events
(`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`, `message_stop`, `ping`, `error`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.base import UINT32_MAX, Part, Probability, Schema, Text, limited, refused
from conveyor.router.api.openai import MAX_MESSAGES, FunctionName
from conveyor.router.api.tgi import Serving

# --- blocks a request carries ---------------------------------------------------------------------------------


class CacheControl(Part):
    """A prompt-cache breakpoint: taken and ignored (Conveyor caches every prompt's blocks, per key)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlockParam(Part):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class Base64ImageSource(Part):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class ImageBlockParam(Part):
    """An image in a user turn, for an image-text model: base64 data only (a `url` source is not fetched)."""

    type: Literal["image"]
    source: Base64ImageSource
    cache_control: CacheControl | None = None

    def data_url(self) -> str:
        return f"data:{self.source.media_type};base64,{self.source.data}"


class ToolUseBlockParam(Part):
    """A call an earlier answer made: the chat's assistant tool call."""

    type: Literal["tool_use"]
    id: Text
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(Part):
    """What a call returned, as text; `is_error` writes `Error: ` before it."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: str | list[TextBlockParam] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(Part):
    """An earlier answer's reasoning: the chat's `reasoning_content` (the chat template decides whether it shows)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(Part):
    """Reasoning another server hid: left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(Part):
    """A turn: text, or blocks. A user's blocks are text, `image` (base64, for an image-text model) and
    `tool_result`; an assistant's text, `tool_use` and `thinking` (documents are not supported)."""

    role: Literal["user", "assistant"]
    content: Annotated[
        str | Annotated[list[Block], Field(min_length=1)],
        Field(description="Text, or content blocks"),
    ]

    @model_validator(mode="after")
    def _rules(self) -> MessageParam:
        if isinstance(self.content, str):
            return self
        kinds = {block.type for block in self.content}
        if self.role == "user" and kinds - {"text", "image", "tool_result"}:
            raise ValueError("a user message carries text, `image` and `tool_result` blocks only")
        if self.role == "assistant" and kinds & {"tool_result", "image"}:
            raise ValueError("an assistant message carries no `tool_result` or `image` blocks")
        return self


# --- tools --------------------------------------------------------------------------------------------------


class ToolParam(Part):
    """A client tool. Server tools (web search, code execution, ...) are not supported."""

    name: FunctionName
    description: str | None = None
    input_schema: Annotated[dict[str, Any], Field(description="The JSON Schema of the tool's input")]
    type: Literal["custom"] | None = None
    strict: Annotated[bool | None, Field(description="A forced call always fits the schema")] = None
    cache_control: CacheControl | None = None


class ToolChoiceAuto(Part):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Part):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Part):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Part):
    type: Literal["none"]


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(
        discriminator="type",
        description="auto (the default with tools): calls are read from the output in the model family's format; "
        "any: at least one call, forced by a grammar; tool: a call to the named tool, its input forced; none: the "
        "tools are not shown",
    ),
]


class ThinkingEnabled(Part):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1, description="Taken, not enforced: max_tokens bounds the output")]


class ThinkingDisabled(Part):
    type: Literal["disabled"]


class ThinkingAdaptive(Part):
    type: Literal["adaptive"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive,
    Field(
        discriminator="type",
        description="For a model that reasons (--reasoning-parser): the chat template's `enable_thinking`, false "
        "when disabled",
    ),
]


class Metadata(Part):
    user_id: str | None = None


# --- the requests ---------------------------------------------------------------------------------------------


class MessagesBase(Schema):
    """What both routes take. The last message is the user's (an assistant turn to continue is not supported);
    `tool_choice` other than auto or none needs `tools`, of unique names, a named one among them."""

    model: Annotated[
        str, Field(description="A LoRA adapter's name selects it (/v1/models); any other name: the base model")
    ] = None  # type: ignore[assignment]
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: Annotated[str | list[TextBlockParam], Field(description="The system prompt: text, or text blocks")] = None  # type: ignore[assignment]
    tools: list[ToolParam] = None  # type: ignore[assignment]
    tool_choice: ToolChoice = None  # type: ignore[assignment]
    thinking: Thinking = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _rules(self) -> MessagesBase:
        if self.messages[-1].role != "user":
            raise ValueError("the last message must be the user's: continuing an assistant turn is not supported")
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("`tools` has two tools of the same name")
        choice = self.tool_choice
        if not self.tools and choice is not None and choice.type not in ("auto", "none"):
            raise ValueError("`tool_choice` needs `tools`")
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            raise ValueError(f"`tool_choice` names {choice.name!r}, which is not in `tools`")
        return self


class MessagesRequest(MessagesBase, Serving):
    """`POST /v1/messages`. The last message is the user's (an assistant turn to continue is not supported);
    `tool_choice` other than auto or none needs `tools`, of unique names, a named one among them."""

    max_tokens: Annotated[int, Field(ge=1, description="Required"), limited("max_total_tokens", 1)]
    stop_sequences: Annotated[list[Text], limited("max_stop_sequences")] = []
    temperature: Annotated[float, Field(ge=0.0, le=1.0, description="0: greedy; unset: the model's default")] = None  # type: ignore[assignment]
    top_p: Probability = None  # type: ignore[assignment]
    top_k: Annotated[int, Field(ge=0, le=UINT32_MAX, description="Only the k most likely tokens (0: off)")] = None  # type: ignore[assignment]
    stream: bool = False
    metadata: Annotated[Metadata, Field(description="Taken and ignored")] = None  # type: ignore[assignment]
    service_tier: refused("auto", "standard_only", why="Not supported") = None


class CountTokensRequest(MessagesBase):
    """`POST /v1/messages/count_tokens`: the prompt `/v1/messages` would run, counted. The last message is the
    user's (an assistant turn to continue is not supported); `tool_choice` other than auto or none needs `tools`,
    of unique names, a named one among them."""


# --- answers ----------------------------------------------------------------------------------------------------


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: Annotated[str, Field(description="Always empty: Conveyor does not sign reasoning")]


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: Annotated[dict[str, Any], Field(description="Empty when the output ended before the input was whole")]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(TypedDict):
    input_tokens: Annotated[int, Field(description="Prompt tokens computed: the prompt less those read from cache")]
    output_tokens: int
    cache_read_input_tokens: Annotated[
        int,
        Field(
            description="Prompt tokens served from the prefix cache (memory or disk tier) instead of being computed: "
            "blocks an earlier prompt of the same key or cache_salt left"
        ),
    ]
    cache_creation_input_tokens: Annotated[int, Field(description="Always 0: caching costs nothing more here")]


class AnthropicMessage(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: Annotated[str | None, Field(description="The stop sequence the output ended with")]
    usage: MessageUsage


class MessageTokensCount(TypedDict):
    input_tokens: int


class AnthropicErrorDetail(TypedDict):
    type: str
    message: str


class AnthropicError(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorDetail
    error_type: NotRequired[Annotated[str, Field(description="Conveyor's kind of error, as every route gives it")]]


class MessageStreamEvent(TypedDict):
    """Every event carries its `type` (message_start, content_block_start, content_block_delta with a text_delta,
    input_json_delta or thinking_delta, content_block_stop, message_delta, message_stop, ping, error); the other
    fields are Anthropic's for that type."""

    type: str
