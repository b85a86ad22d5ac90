"""Structured output and tool calls end to end through the unmodified `openai` SDK, and auto mode's reading of the
demo template's (Hermes) calls.

The tiny model's weights are random: it never writes a `<tool_call>` on its own, so auto mode's parser is
tested on hand-written output (each family's through the server too: test_chat_families.py). Schemas here are
bounded (enums, integer ranges, short lists) so that constrained outputs finish within a few dozen tokens. The test
model declares an ordinary token (" >=") as a second EOS id (see conftest), which a grammar allows inside a string:
there it is text, and a forced call goes on to whole JSON (`test_a_forced_call_goes_on_past_an_eos_id_in_its_json`).
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from conftest import Server
from pydantic import BaseModel, Field

from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.pipeline.chat_output import ChatOutput
from conveyor.router.pipeline.tools import tool_use

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
            "required": ["hour", "loud"],
        },
    },
}
TOOLS = [WEATHER, ALARM]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Verdict(BaseModel):
    verdict: Literal["yes", "no", "maybe"]
    color: Color
    score: int = Field(ge=0, le=9)
    tags: list[Literal["a", "b"]] = Field(max_length=2)


class SetAlarm(BaseModel):
    """Sets an alarm."""

    hour: int = Field(ge=0, le=23)
    loud: bool
    day: Literal["mon", "tue"]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _model(server: Server) -> str:
    return str(server.model_dir)


# --- structured output ---------------------------------------------------------------------------------------


def test_parse_gives_the_pydantic_model_streamed_or_not(client: openai.OpenAI, server: Server) -> None:
    """`parse` sends the model's strict JSON schema; the grammar makes any output parse, and the SDK checks it."""
    request = dict(model=_model(server), messages=MESSAGES, response_format=Verdict, max_tokens=120, temperature=0)
    completion = client.chat.completions.parse(**request)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Verdict)
    jsonschema.validate(json.loads(choice.message.content), Verdict.model_json_schema())
    with client.chat.completions.stream(**request) as stream:
        kinds = {event.type for event in stream}
        streamed = stream.get_final_completion().choices[0]
    assert "content.delta" in kinds and streamed.finish_reason == "stop"
    assert streamed.message.parsed == choice.message.parsed  # greedy: the same text, token by token


def test_response_format_json_schema_and_json_object(client: openai.OpenAI, server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "unit": {"enum": ["m", "s"]},
        },
        "required": ["ok", "count", "unit"],
    }
    chat = client.chat.completions.create(
        model=_model(server),
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "reading", "schema": schema}},
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    any_object = client.chat.completions.create(
        model=_model(server), messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "json_object"}
    )
    assert any_object.choices[0].message.content.startswith("{")  # random weights write keys for ever: cut short
    completion = client.completions.create(
        model=_model(server),
        prompt="x",
        max_tokens=30,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].finish_reason == "stop" and isinstance(json.loads(completion.choices[0].text), dict)


def test_vllm_fields_on_completions(client: openai.OpenAI, server: Server, text_eos: str) -> None:
    def text(seed: int, **extra: Any) -> str:
        completion = client.completions.create(
            model=_model(server), prompt="def f():", max_tokens=40, temperature=1.0, seed=seed, extra_body=extra
        )
        assert completion.choices[0].finish_reason == "stop"
        return completion.choices[0].text.removesuffix(text_eos)

    choices = ["alpha", "beta", "gamma delta"]
    assert {text(seed, guided_choice=choices) for seed in range(3)} <= set(choices)
    assert re.fullmatch(r"[0-9]{2}-[a-c]{1,3}", text(1, guided_regex=r"[0-9]{2}-[a-c]{1,3}"))
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3}
    jsonschema.validate(json.loads(text(2, structured_outputs={"json": schema})), schema)
    assert text(3, structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    assert re.fullmatch(r"x[yz]", text(4, guided_grammar='start: "x" ("y" | "z")'))


# --- tool calls ----------------------------------------------------------------------------------------------


def _streamed_calls(chunks: list) -> tuple[list[dict], str | None]:
    """The calls a stream's deltas add up to (by index: the first delta names it, the others add arguments)."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def _check_calls(calls: list[dict], finish_reason: str | None) -> None:
    """Every call names a listed tool, with arguments that are JSON text valid for that tool's parameters."""
    assert calls and finish_reason == "tool_calls"
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in PARAMETERS
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


FORCED = [
    pytest.param({"tool_choice": "required"}, id="required"),
    pytest.param({"tool_choice": "required", "parallel_tool_calls": False}, id="required-one"),
    pytest.param({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, id="named"),
]


@pytest.mark.parametrize("forced", FORCED)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_calls(client: openai.OpenAI, server: Server, forced: dict, stream: bool) -> None:
    request = dict(model=_model(server), messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0, **forced)
    if stream:
        calls, finish = _streamed_calls(list(client.chat.completions.create(stream=True, **request)))
    else:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.message.content is None and choice.message.role == "assistant"
        calls = [{"id": c.id, **c.function.model_dump()} for c in choice.message.tool_calls]
        finish = choice.finish_reason
    _check_calls(calls, finish)
    if "parallel_tool_calls" in forced or isinstance(forced["tool_choice"], dict):
        assert len(calls) == 1
    if isinstance(forced["tool_choice"], dict):
        assert calls[0]["name"] == "get_weather"


def _eos_call(server: Server, text_eos: str) -> dict[str, Any]:
    """A greedy chat forced to call a function whose one argument the grammar writes as the text of the test
    model's ordinary EOS token, four times: llguidance forces that text as the token itself, so the request samples
    that EOS id inside a JSON string. Its tokens come with logprobs."""
    parameters = {"type": "object", "properties": {"op": {"const": text_eos * 4}}, "required": ["op"]}
    tool = {"type": "function", "function": {"name": "compare", "parameters": parameters}}
    named = {"type": "function", "function": {"name": "compare"}}
    return dict(model=_model(server), messages=MESSAGES, tools=[tool], tool_choice=named, temperature=0, logprobs=True)


def _forced_call(client: openai.OpenAI, stream: bool, **request: Any) -> tuple[list[dict], str | None, list[str]]:
    """A chat's calls, its finish reason and its tokens' texts, streamed or whole (the request asks for logprobs)."""
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **request))
        calls, finish = _streamed_calls(chunks)
        logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        return calls, finish, [t.token for lp in logprobs for t in lp.content]
    choice = client.chat.completions.create(**request).choices[0]
    calls = [{"id": c.id, **c.function.model_dump()} for c in choice.message.tool_calls]
    return calls, choice.finish_reason, [t.token for t in choice.logprobs.content]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_call_goes_on_past_an_eos_id_in_its_json(
    client: openai.OpenAI, server: Server, text_eos: str, stream: bool
) -> None:
    """Issue 60: a forced call ended with `tool_calls` and arguments `{"city": ") >=`, cut where the model sampled
    the ordinary token the test model declares as an EOS id inside the string. The grammar reads it as text there,
    so the request goes on, and ends when the JSON is whole."""
    calls, finish, tokens = _forced_call(client, stream, max_tokens=40, **_eos_call(server, text_eos))
    assert tokens.count(text_eos) == 4  # the EOS id, sampled inside the string each time
    assert finish == "tool_calls" and [json.loads(c["arguments"]) for c in calls] == [{"op": text_eos * 4}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_sequence_inside_a_forced_call_ends_it_with_stop(
    client: openai.OpenAI, server: Server, text_eos: str, stream: bool
) -> None:
    """A stop sequence met inside a forced call's JSON leaves its arguments cut short: the choice ends with `stop`,
    not `tool_calls`, which would tell the client to run a call whose arguments are not JSON."""
    calls, finish, _ = _forced_call(client, stream, max_tokens=40, stop=[text_eos * 2], **_eos_call(server, text_eos))
    assert finish == "stop" and [c["arguments"] for c in calls] == ['{"op": "' + text_eos * 2]


def test_a_tool_round_trip(client: openai.OpenAI, server: Server) -> None:
    """The assistant's calls and the tool's answer go back in the next request, through the chat template."""
    first = client.chat.completions.create(
        model=_model(server), messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    message = first.choices[0].message
    answers = [{"role": "tool", "tool_call_id": call.id, "content": "18 degrees"} for call in message.tool_calls]
    messages = [*MESSAGES, message.model_dump(exclude_none=True), *answers]
    second = client.chat.completions.create(model=_model(server), messages=messages, tools=TOOLS, max_tokens=5)
    assert second.choices[0].message.role == "assistant" and second.choices[0].finish_reason in ("stop", "length")
    # the prompt grew by the calls and the answers
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + len(answers)


def test_tool_choice_auto_gives_a_well_formed_answer(client: openai.OpenAI, server: Server) -> None:
    """On random weights auto mode is almost surely plain content; streamed, the same content."""
    request = dict(model=_model(server), messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0)
    choice = client.chat.completions.create(**request).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **request))
    calls, finish = _streamed_calls(chunks)
    if choice.message.tool_calls:
        _check_calls([{"id": c.id, **c.function.model_dump()} for c in choice.message.tool_calls], choice.finish_reason)
        return
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not calls and finish == choice.finish_reason and streamed == choice.message.content


def test_pydantic_function_tool_with_parse(client: openai.OpenAI, server: Server) -> None:
    tool = openai.pydantic_function_tool(SetAlarm)
    request = dict(model=_model(server), messages=MESSAGES, tools=[tool], max_tokens=80, temperature=0)
    completion = client.chat.completions.parse(tool_choice="required", **request)
    (call,) = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, SetAlarm) and completion.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "SetAlarm"}}
    with client.chat.completions.stream(tool_choice=named, **request) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion().choices[0]
    assert "tool_calls.function.arguments.delta" in kinds and final.finish_reason == "tool_calls"
    assert isinstance(final.message.tool_calls[0].function.parsed_arguments, SetAlarm)


REFUSED = [
    pytest.param(
        "chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, id="unknown-tool"
    ),
    pytest.param(
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
        id="invalid-schema",
    ),
    pytest.param("completion", {"extra_body": {"guided_regex": "(unclosed"}}, id="invalid-regex"),
    pytest.param("completion", {"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, id="two-constraints"),
    pytest.param("completion", {"extra_body": {"guided_grammar": "start: undefined_rule"}}, id="invalid-grammar"),
]


@pytest.mark.parametrize(("route", "fields"), REFUSED)
def test_what_cannot_be_enforced_is_a_422(client: openai.OpenAI, server: Server, route: str, fields: dict) -> None:
    with pytest.raises(openai.UnprocessableEntityError) as error:
        if route == "chat":
            client.chat.completions.create(model=_model(server), messages=MESSAGES, max_tokens=4, **fields)
        else:
            client.completions.create(model=_model(server), prompt="x", max_tokens=4, **fields)
    assert error.value.body["type"] == "invalid_request_error" and error.value.body["message"]


# --- auto mode's parser (no server) -----------------------------------------------------------------------------


def _tool_use(**fields: Any) -> Any:
    return tool_use(parse(ChatRequest, {"messages": MESSAGES, **fields}))


AUTO = _tool_use(tools=TOOLS)


def test_tool_use_reads_tools_and_tool_choice() -> None:
    assert AUTO.choice == "auto" and [t.name for t in AUTO.tools] == ["get_weather", "set_alarm"]
    assert AUTO.template_tools() == TOOLS  # the tools as sent, for the chat template
    assert _tool_use() is None and _tool_use(tools=TOOLS, tool_choice="none") is None
    named = _tool_use(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    assert (named.choice, named.name) == ("named", "set_alarm")
    required = _tool_use(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert (required.choice, required.parallel) == ("required", False)
    bare = _tool_use(tools=[{"type": "function", "function": {"name": "ping"}}])
    assert bare.tools[0].parameters == {"type": "object"}  # no parameters: any JSON object


def test_tool_use_refuses_what_the_schema_cannot_say() -> None:
    with pytest.raises(ValidationError, match="^`tools` has two functions of the same name$"):
        _tool_use(tools=[WEATHER, WEATHER])
    with pytest.raises(ValidationError, match="`tool_choice` names the function `nope`, which is not in `tools`"):
        _tool_use(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


HERMES = (
    "Let me check. "
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    " <tool_call>not JSON</tool_call> "
    '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "loud": false}}\n</tool_call>'
    " then <tool_call>"
)


def test_auto_mode_reads_hermes_calls_out_of_the_output() -> None:
    parsed = ChatOutput(AUTO).parse(HERMES)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("set_alarm", {"hour": 7, "loud": False}),
    ]
    assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == 2
    # the malformed block and the unfinished tail stay content; the calls are cut out
    assert parsed.content == "Let me check.  <tool_call>not JSON</tool_call>  then <tool_call>"
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert (ChatOutput(AUTO).parse(unknown).content, ChatOutput(AUTO).parse(unknown).calls) == (unknown, [])
    assert ChatOutput(AUTO).parse("just words").content == "just words"


def _stream(use: Any, pieces: list[str]) -> list[str | None]:
    """The content each piece (and the end) sends."""
    output = ChatOutput(use)
    groups = [output.feed(piece) for piece in pieces] + [output.finish()]
    return ["".join(d.content for d in group) or None for group in groups]


def test_auto_mode_streams_content_and_holds_back_what_may_be_a_call() -> None:
    assert _stream(AUTO, ["Hi", " there <to", "ol", " maybe"]) == ["Hi", " there", None, " <tool maybe", None]
    assert _stream(AUTO, ["Hi <tool", "_call>"]) == ["Hi", None, " <tool_call>"]  # released at the end: no call


@pytest.mark.parametrize("text", [HERMES, " " + HERMES + " after\n", "\nok"], ids=["hermes", "padded", "plain"])
def test_auto_mode_streamed_is_the_whole_answer_in_pieces(text: str) -> None:
    """Fed a few characters at a time, the pieces add up to what the finished output parses to: the content,
    and each call named in its first piece, its arguments in the others."""
    parsed = ChatOutput(AUTO).parse(text)
    output = ChatOutput(AUTO)
    deltas = [d for i in range(0, len(text), 3) for d in output.feed(text[i : i + 3])] + output.finish()
    assert "".join(d.content for d in deltas) == (parsed.content or "")
    firsts = [d for d in deltas if d.call_id is not None]
    arguments = ["".join(d.arguments for d in deltas if d.call_index == i) for i in range(len(firsts))]
    assert [(d.call_index, d.call_name, a) for d, a in zip(firsts, arguments)] == [
        (i, c.name, c.arguments) for i, c in enumerate(parsed.calls)
    ]
