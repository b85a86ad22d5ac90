"""OpenAI's Responses API as Conveyor serves it: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A Responses request is a chat in another shape: `instructions` and `input` (text, or items: messages, function calls
and their outputs, reasoning) become the chat's messages, function `tools` and `tool_choice` its tools, `text.format`
its `response_format`, `max_output_tokens` its `max_tokens`. What the API has and Conveyor does not (built-in tools,
background runs, conversations, prompt templates, `include`) is refused by name, as every front door refuses fields.
Answers are the Response object and, when streaming, its typed events (`response.created`,
`response.output_text.delta`, `response.function_call_arguments.delta`, `response.completed`, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.base import Part, Probability, Schema, Text, limited, refused
from conveyor.router.api.constraints import SchemaOrText
from conveyor.router.api.openai import MAX_MESSAGES, MAX_TEMPERATURE, FunctionName, FunctionSpec
from conveyor.router.api.tgi import Serving

RESPONSE_ID = r"^resp_[A-Za-z0-9]{1,64}$"


# --- input -------------------------------------------------------------------------------------------------------


class _Item(Part):
    """An item as a client sends it back from an earlier response: fields Conveyor does not read (ids, status)
    pass."""

    model_config = ConfigDict(extra="allow")


class InputText(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputImage(_Item):
    type: Literal["input_image"]
    image_url: Annotated[
        str,
        Field(description="A base64 data URL (data:image/png;base64,...), or http(s) where the server fetches URLs"),
    ]
    detail: Literal["auto", "low", "high"] | None = None


InputPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[
        str | list[InputPart],
        Field(description="Text, or parts: input_text, output_text, input_image (for an image-text model)"),
    ]

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: its text, or, with images, OpenAI chat's text and image_url parts."""
        if isinstance(self.content, str):
            return self.content
        if not any(isinstance(p, InputImage) for p in self.content):
            return "".join(p.text for p in self.content)
        return [
            {"type": "image_url", "image_url": {"url": p.image_url}}
            if isinstance(p, InputImage)
            else {"type": "text", "text": p.text}
            for p in self.content
        ]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Text
    name: FunctionName
    arguments: Annotated[str, Field(description="JSON text")]


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Text
    output: Annotated[str, Field(description="What the function returned, as text")]


class ReasoningItem(_Item):
    """A reasoning item of an earlier response, sent back: kept out of the next prompt, as chat templates drop
    earlier turns' reasoning."""

    type: Literal["reasoning"]


def _item_type(value: Any) -> str:
    """An item's `type`; a message may leave it out (OpenAI's "easy" input message)."""
    found = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return found if isinstance(found, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(FunctionSpec):
    """The chat route's function, flat: `{"type": "function", "name": ..., "parameters": ...}`."""

    type: Literal["function"]


class NamedTool(Part):
    type: Literal["function"]
    name: FunctionName


class TextFormatText(Part):
    type: Literal["text"]


class TextFormatJsonObject(Part):
    type: Literal["json_object"]


class TextFormatJsonSchema(Part):
    type: Literal["json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] = "output"
    schema_: Annotated[SchemaOrText, Field(alias="schema")]
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
    Field(discriminator="type", description="text (default), json_object, or json_schema: the output matches it"),
]


class TextConfig(Schema):
    format: TextFormat | None = None
    verbosity: refused("medium", why="Not supported") = None


class ResponsesRequest(Serving):
    """`input` as text or items (reasoning items alone answer nothing), at most as many items as a chat has
    messages; `previous_response_id` continues a
    stored response (its key's only); a `tool_choice` other than auto or none needs `tools`, a named one among
    them; `text.format` other than text cannot come with a forced tool call."""

    model: Annotated[
        str, Field(description="A LoRA adapter's name selects it (/v1/models); any other name: the base model")
    ] = None  # type: ignore[assignment]
    input: Annotated[
        Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)],
        Field(description="The user's text, or items: messages, function calls and their outputs"),
    ]
    instructions: Annotated[str, Field(description="The system message, before the input")] = None  # type: ignore[assignment]
    previous_response_id: Annotated[
        str, Field(pattern=RESPONSE_ID, description="Continue from a stored response: its input and output come first")
    ] = None  # type: ignore[assignment]
    tools: Annotated[list[FunctionTool], Field(description="Function tools only; names are unique")] = None  # type: ignore[assignment]
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedTool,
        Field(description="none, auto (the default with tools), required (a call is forced), or a named function"),
    ] = None  # type: ignore[assignment]
    parallel_tool_calls: bool = True
    text: TextConfig = None  # type: ignore[assignment]
    max_output_tokens: Annotated[int, Field(ge=1), limited("max_total_tokens", 1)] = None  # type: ignore[assignment]
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, description="0: greedy")] = None  # type: ignore[assignment]
    top_p: Probability = None  # type: ignore[assignment]
    stream: bool = False
    store: Annotated[bool, Field(description="Keep the response for previous_response_id and GET")] = True
    # OpenAI's bounds: 16 pairs, keys of 64 characters at most, values of 512.
    metadata: Annotated[
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
    ] = None  # type: ignore[assignment]
    user: str = None  # type: ignore[assignment]
    # The Responses API's features Conveyor does not implement.
    background: refused(False, why="Not supported: responses run in the foreground") = None
    conversation: refused(why="Not supported: use previous_response_id") = None
    prompt: refused(why="Not supported: no stored prompt templates") = None
    include: refused([], why="Not supported") = None
    reasoning: refused(why="Not supported: a model that reasons does so by its chat template") = None
    truncation: refused("disabled", why="Not supported: a prompt too long is refused") = None
    service_tier: refused("auto", "default", why="Not supported") = None
    top_logprobs: refused(0, why="Not supported on this route") = None
    max_tool_calls: refused(why="Not supported") = None

    @model_validator(mode="after")
    def _rules(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("`tools` has two functions of the same name")
        choice = self.tool_choice
        if not self.tools and choice not in (None, "none", "auto"):
            raise ValueError("`tool_choice` needs `tools`")
        if isinstance(choice, NamedTool) and choice.name not in names:
            raise ValueError(f"`tool_choice` names {choice.name!r}, which is not in `tools`")
        forced = choice == "required" or isinstance(choice, NamedTool)
        if forced and self.text is not None and self.text.format is not None and self.text.format.type != "text":
            raise ValueError("a `text.format` other than text cannot be combined with this `tool_choice`")
        return self


# --- answers ------------------------------------------------------------------------------------------------------


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(TypedDict):
    type: Literal["message"]
    id: str
    status: Literal["completed", "incomplete", "in_progress"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "incomplete", "in_progress"]


class OutputReasoning(TypedDict):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(TypedDict):
    cached_tokens: Annotated[
        int,
        Field(
            description="Input tokens served from the prefix cache (memory or disk tier) instead of being computed: "
            "blocks an earlier prompt of the same key or cache_salt left"
        ),
    ]


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(TypedDict):
    reason: Literal["max_output_tokens", "stop"]  # stop: it ended before a function call's arguments were whole


class Response(TypedDict):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    previous_response_id: str | None
    text: dict[str, Any]
    store: bool
    metadata: dict[str, str]
    output_text: NotRequired[str]


class ResponseDeleted(TypedDict):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class ResponseStreamEvent(TypedDict):
    """Every event carries its `type` (response.created, response.output_item.added, response.content_part.added,
    response.output_text.delta / .done, response.reasoning_text.delta / .done,
    response.function_call_arguments.delta / .done, response.content_part.done, response.output_item.done,
    response.completed or response.incomplete, error) and a `sequence_number`; the other fields are OpenAI's for
    that type."""

    type: str
    sequence_number: int
