"""OpenAI's API as Conveyor serves it: `/v1/completions`, `/v1/chat/completions` and `/v1/models`, with vLLM's
extensions (its structured-output fields, and TGI's sampling fields under the same names: `top_k`, `min_p`,
`repetition_penalty`...). OpenAI fields Conveyor does not implement are declared with `refused`; `model` and
`user` are taken and ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.base import Part, Text, limited, refused
from conveyor.router.api.constraints import ConstraintFields
from conveyor.router.api.tgi import MIN_POSITIVE, Serving, SharedSampling

MAX_CHOICES = 8  # n, and prompts per completion request, at most
MAX_MESSAGES = 1024  # messages per chat request: far beyond any conversation that fits a context window
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


def _greedy_or_floor(temperature: float) -> float:
    """0 means greedy; a positive temperature too small for the float32 wire is the floor TGI's takes."""
    return temperature if temperature == 0 else max(temperature, MIN_POSITIVE)


class StreamOptions(Part):
    include_usage: bool | None = None


class OpenAIRequest(SharedSampling, ConstraintFields, Serving):
    """What both OpenAI routes take (each route's docstring gives the rules between fields)."""

    model: Annotated[
        str, Field(description="A LoRA adapter's name selects it (/v1/models); any other name: the base model")
    ] = None  # type: ignore[assignment]
    user: str = None  # type: ignore[assignment]
    max_tokens: Annotated[int, Field(ge=1), limited("max_total_tokens", 1)] = None  # type: ignore[assignment]
    temperature: Annotated[
        float,
        Field(ge=0.0, le=MAX_TEMPERATURE, description="0: greedy; unset: the model's default, else 1"),
        AfterValidator(_greedy_or_floor),
    ] = None  # type: ignore[assignment]
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: Annotated[Text | list[Text], limited("max_stop_sequences")] = []
    stream: bool = False
    stream_options: Annotated[StreamOptions, Field(description="Only with `stream: true`")] = None  # type: ignore[assignment]
    ignore_eos: bool = False
    logit_bias: refused({}, why="Not supported") = None

    @model_validator(mode="after")
    def _rules(self) -> OpenAIRequest:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        if len(found := self.constraint_fields()) > 1:
            raise ValueError(f"at most one constraint per request. Given: {', '.join(found)}")
        return self


class CompletionRequest(OpenAIRequest):
    """Prompts times `n` at most 8; `stream_options` only with `stream: true`; at most one structured-output
    constraint (a `response_format` other than text, `structured_outputs`, a `guided_*` field)."""

    prompt: Annotated[
        Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)],
        Field(description=f"Prompts times `n` at most {MAX_CHOICES}"),
    ]
    logprobs: Annotated[int, Field(ge=0, description="Alternatives per token"), limited("max_top_n_tokens")] = 0
    echo: refused(False, why="Not supported") = None
    suffix: refused(why="Not supported") = None
    best_of: refused(1, why="Only 1") = None

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


# --- chat --------------------------------------------------------------------------------------------------------


class _Open(Part):
    """A part of a message as OpenAI returns it, which clients send back whole: fields beyond those named pass
    to the chat template."""

    model_config = ConfigDict(extra="allow")


FunctionName = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="OpenAI's rule: 1-64 letters, digits, _ . -")
]


class CalledFunction(_Open):
    name: FunctionName  # a history's call names the function as the Responses API's items must
    arguments: Annotated[Any, Field(description="JSON text, as OpenAI sends it (or the arguments themselves)")] = "{}"


class MessageToolCall(_Open):
    id: Annotated[Any, Field(description="The call's id, as the response gave it")] = None
    type: Annotated[Any, Field(description="function")] = None
    function: CalledFunction


class TextContent(Part):
    type: Literal["text"]
    text: str


class ImageUrl(Part):
    url: Annotated[
        str,
        Field(description="A base64 data URL (data:image/png;base64,...), or http(s) where the server fetches URLs"),
    ]
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(Part):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class Message(Part):
    """A message: system, user, assistant or tool. An assistant's may carry `tool_calls` instead of content (as
    OpenAI returns them: arguments as JSON text); any other message needs a string `content` (or a list of text and
    image parts, images for an image-text model only); a tool's answers one of those calls by its `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[
        str | list[ContentPart] | None, Field(description="Required (a string or parts) unless tool calls")
    ] = None
    name: str | None = None
    tool_calls: Annotated[list[MessageToolCall] | None, Field(description="Only on assistant messages")] = None
    tool_call_id: Annotated[str | None, Field(description="Required on tool messages")] = None
    reasoning_content: Annotated[
        str | None,
        Field(description="Only on assistant messages: their reasoning, as the answer gave it"),
    ] = None

    @model_validator(mode="after")
    def _rules(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry `tool_calls`")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry `reasoning_content`")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a message of role tool needs the string `tool_call_id` it answers")
        if not self.tool_calls and self.content is None:
            raise ValueError("each message needs a string `content`")
        return self


class FunctionSpec(Part):
    name: FunctionName
    description: str | None = None
    parameters: Annotated[
        dict[str, Any] | None, Field(description="The JSON Schema of the arguments (default: any JSON object)")
    ] = None
    strict: bool | None = None


class Tool(Part):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Part):
    name: Annotated[str, Field(description="One of `tools`")]


class NamedToolChoice(Part):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(OpenAIRequest):
    """`stream_options` only with `stream: true`; at most one structured-output constraint (a `response_format`
    other than text, `structured_outputs`, a `guided_*` field); `top_logprobs` needs `logprobs: true`; a
    `tool_choice` other than none needs `tools`, of unique names, and a named one must be among them; a forced
    call (`required` or a named function) is a constraint, so it cannot come with another; `max_tokens` and
    `max_completion_tokens`, if both are given, are equal."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[
        int,
        Field(ge=1, description="OpenAI's newer name for `max_tokens`; given both, their values must be equal"),
        limited("max_total_tokens", 1),
    ] = None  # type: ignore[assignment]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0), limited("max_top_n_tokens")] = 0
    tools: Annotated[
        list[Tool],
        Field(description="Functions the model may call, shown to it by the chat template; names are unique"),
    ] = None  # type: ignore[assignment]
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedToolChoice,
        Field(
            description="none: no tools; auto (the default with tools): calls are read from the output in the "
            "model family's format (--tool-call-parser); required: at least one call, forced by a grammar; a named "
            "function: a call to it, its arguments forced"
        ),
    ] = None  # type: ignore[assignment]
    parallel_tool_calls: Annotated[bool, Field(description="With `required`: false allows one call only")] = True
    chat_template_kwargs: Annotated[
        dict[str, Any],
        Field(
            description='More variables for the chat template, such as `{"enable_thinking": false}`; the names '
            "the router sets itself (`messages`, `tools`, `add_generation_prompt`, `tokenize`...) and the special "
            "tokens' are refused"
        ),
    ] = None  # type: ignore[assignment]
    functions: refused([], why="Not supported: use `tools`") = None
    function_call: refused("none", why="Not supported: use `tool_choice`") = None

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens not in (None, self.max_tokens):
            raise ValueError("`max_tokens` and `max_completion_tokens` name one limit: give one, or equal values")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        if not self.tools and self.tool_choice not in (None, "none"):
            raise ValueError("`tool_choice` needs `tools`")
        return self


# --- answers -----------------------------------------------------------------------------------------------------


class ErrorObject(TypedDict):
    message: str
    type: str
    param: NotRequired[None]
    code: NotRequired[None]


class OpenAIError(TypedDict):
    error: ErrorObject
    error_type: str


class PromptTokensDetails(TypedDict):
    cached_tokens: Annotated[
        int,
        Field(
            description="Prompt tokens served from the prefix cache (memory or disk tier) instead of being computed: "
            "blocks an earlier prompt of the same key or cache_salt left"
        ),
    ]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class LogprobEntry(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobs(LogprobEntry):
    top_logprobs: list[LogprobEntry]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprobs]


Finish = Literal["stop", "length"] | None
ChatFinish = Annotated[
    Literal["stop", "length", "tool_calls"] | None, Field(description="tool_calls: the choice ended with tool calls")
]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Finish


class CalledFunctionOut(TypedDict):
    name: str
    arguments: Annotated[str, Field(description="JSON text")]


CALL_ID = "^(call_|[A-Za-z0-9]{9}$)"  # OpenAI's shape; Mistral-family models: 9 letters and digits


class ToolCall(TypedDict):
    id: Annotated[str, Field(pattern=CALL_ID)]
    type: Literal["function"]
    function: CalledFunctionOut


class ToolCallDelta(TypedDict):
    """A call's first delta has its id, type and name; later ones add to its arguments."""

    index: int
    id: NotRequired[Annotated[str, Field(pattern=CALL_ID)]]
    type: NotRequired[Literal["function"]]
    function: NotRequired[dict[str, str]]


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: Annotated[str | None, Field(description="null when the answer is tool calls or reasoning only")]
    reasoning_content: NotRequired[
        Annotated[str | None, Field(description="A reasoning model's <think> block (--reasoning-parser)")]
    ]
    tool_calls: NotRequired[list[ToolCall]]


class Delta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallDelta]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


class ChatChunkChoice(TypedDict):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinish


class _Envelope(TypedDict):
    id: str
    created: int
    model: str


class Completion(_Envelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Envelope):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: NotRequired[Usage]


class ChatCompletion(_Envelope):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage]


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: NotRequired[
        Annotated[str, Field(description="An adapter's source, a directory or a Hub id: shown to an admin key only")]
    ]
    parent: NotRequired[Annotated[str, Field(description="An adapter's base model: the first card's id")]]


class Models(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]
