"""Tool calls through the server for each model family, with the unmodified `openai` SDK, streamed and not: a test
model per family (tests/conftest.py: the tiny model with that family's chat template, tests/chat_templates.py),
whose family the router finds from its template alone.

Random weights never write a family's markers on their own, so `tool_choice: "auto"` gets them by a grammar: a
`structured_outputs` choice whose one string is the family's call text makes the real server generate exactly
that, and the parser under test reads it. The forced modes need no such help. `enable_thinking: false` keeps
the Qwen3-shaped model (which reasons) out of a reasoning block here; reasoning has tests of its own
(test_reasoning_serving.py).
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from conftest import Server

MESSAGES = [{"role": "user", "content": "What is the weather in Paris? And wake me at 7."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
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
EXTRA = {"chat_template_kwargs": {"enable_thinking": False}}

PARIS, SEVEN = '{"city": "Paris", "unit": "C"}', '{"hour": 7, "loud": false}'
EXPECTED_CALLS = [("get_weather", PARIS), ("set_alarm", SEVEN)]
# Each family's own output for two parallel calls (after a sentence, where the format has room for one).
OUTPUTS = {
    "hermes": (
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "set_alarm", "arguments": {SEVEN}}}\n</tool_call>',
        "Let me check.",
    ),
    "llama3_json": (
        f'{{"name": "get_weather", "parameters": {PARIS}}}; {{"name": "set_alarm", "parameters": {SEVEN}}}',
        None,
    ),
    "mistral": (
        f'Let me check. [TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, '
        f'{{"name": "set_alarm", "arguments": {SEVEN}}}]',
        "Let me check.",
    ),
    "phi4_mini_json": (
        f'Let me check.<|tool_call|>[{{"name": "get_weather", "arguments": {PARIS}}}, '
        f'{{"name": "set_alarm", "arguments": {SEVEN}}}]<|/tool_call|>',
        "Let me check.",
    ),
}
MARKERS = ("tool_call", "TOOL_CALLS", "python_tag")
FAMILIES = list(OUTPUTS)
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


@pytest.fixture(scope="module")
def servers(
    qwen3_chat_server: Server, llama3_chat_server: Server, mistral_chat_server: Server, phi4_chat_server: Server
) -> dict[str, Server]:
    return {
        "hermes": qwen3_chat_server,
        "llama3_json": llama3_chat_server,
        "mistral": mistral_chat_server,
        "phi4_mini_json": phi4_chat_server,
    }


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _answer(server: Server, stream: bool, **request) -> dict:
    """The choice's content, calls (id, name, arguments), finish reason and reasoning, read from the message or
    added up from the stream's deltas (checking each call's first delta names it, the others only add)."""
    client = _client(server)
    request = {"model": "x", "messages": MESSAGES, "tools": TOOLS, "temperature": 0, **request}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        content = choice.message.content or None
        return {"content": content, "calls": calls, "finish": choice.finish_reason, "reasoning": reasoning}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.id, piece.function.name, ""]
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index][2] += piece.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    listed = [tuple(calls[i]) for i in sorted(calls)]
    return {"content": content or None, "calls": listed, "finish": finish, "reasoning": reasoning or None}


def _check_ids(family: str, calls: list[tuple]) -> None:
    pattern = "[A-Za-z0-9]{9}" if family == "mistral" else "call_[0-9a-f]{24}"
    assert all(re.fullmatch(pattern, call_id) for call_id, _, _ in calls)
    assert len({call_id for call_id, _, _ in calls}) == len(calls)


@pytest.mark.parametrize("family", FAMILIES)
@STREAM
def test_auto_reads_the_family_s_own_calls(servers: dict[str, Server], family: str, stream: bool) -> None:
    text, content = OUTPUTS[family]
    answer = _answer(
        servers[family], stream, max_tokens=400, extra_body={**EXTRA, "structured_outputs": {"choice": [text]}}
    )
    assert [(name, arguments) for _, name, arguments in answer["calls"]] == EXPECTED_CALLS
    assert answer["content"] == content and answer["finish"] == "tool_calls" and answer["reasoning"] is None
    _check_ids(family, answer["calls"])


FORCED = [
    pytest.param("required", id="required"),
    pytest.param({"type": "function", "function": {"name": "set_alarm"}}, id="named"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool_choice", FORCED)
@STREAM
def test_forced_calls_are_read_whatever_the_family(
    servers: dict[str, Server], family: str, tool_choice: str | dict, stream: bool
) -> None:
    answer = _answer(servers[family], stream, tool_choice=tool_choice, max_tokens=120, extra_body=EXTRA)
    assert answer["calls"] and answer["finish"] == "tool_calls" and answer["content"] is None
    for _, name, arguments in answer["calls"]:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    if isinstance(tool_choice, dict):
        assert [name for _, name, _ in answer["calls"]] == ["set_alarm"]
    _check_ids(family, answer["calls"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_calls_go_back_through_the_family_s_template(servers: dict[str, Server], family: str) -> None:
    """The assistant's calls and the tools' answers in the next request. Mistral's template refuses any id that
    is not 9 letters and digits (an OpenAI-shaped id is a 422 there), so this holds the ids to the family's rule."""
    client = _client(servers[family])
    first = client.chat.completions.create(
        model="x",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        extra_body=EXTRA,
    )
    message = first.choices[0].message.model_dump(exclude_none=True)
    answers = [{"role": "tool", "tool_call_id": c["id"], "content": "18 degrees"} for c in message["tool_calls"]]
    second = client.chat.completions.create(
        model="x", messages=[*MESSAGES, message, *answers], tools=TOOLS, max_tokens=4
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    if family == "mistral":
        openai_shaped = [{**call, "id": "call_" + call["id"]} for call in message["tool_calls"]]
        with pytest.raises(openai.UnprocessableEntityError, match="could not render"):
            client.chat.completions.create(
                model="x", messages=[*MESSAGES, {**message, "tool_calls": openai_shaped}, *answers], max_tokens=4
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_passes_plain_text_through(servers: dict[str, Server], family: str) -> None:
    """What random weights write is text: content, the same streamed and whole, with no marker in it."""
    whole = _answer(servers[family], False, max_tokens=16, extra_body=EXTRA)
    streamed = _answer(servers[family], True, max_tokens=16, extra_body=EXTRA)
    assert whole == streamed and not whole["calls"] and whole["finish"] in ("stop", "length")
    assert not any(m in (whole["content"] or "") for m in MARKERS)
