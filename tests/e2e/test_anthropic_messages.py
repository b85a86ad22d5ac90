"""Anthropic's Messages API through the real processes, driven by the unmodified `anthropic` SDK: a message equal to
the chat route's greedy text, a stream and its event order, the stop reasons, a forced tool call whose input fits its
schema, a tool result turn, count_tokens, the `x-api-key` header, errors in Anthropic's shape, the refusal counted
and a hang-up cancelling its request; and, without a server, reasoning as thinking blocks. One deployment (the tiny
model, behind an API key) for the module. The weights are random, so the text is gibberish: tools are forced by
their grammars, which is what makes their output checkable."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
from conftest import Server, start_server, wait_for

from conveyor.router.api import anthropic as api
from conveyor.router.api.base import parse
from conveyor.router.core.events import Finished
from conveyor.router.frontends.anthropic_events import MessageEvents, content_of, message, stop_of, usage
from conveyor.router.pipeline.chat_output import ChatOutput
from conveyor.router.pipeline.reasoning import Reasoning

KEY = "anthropic-test-key"
SYSTEM = "Be brief."
QUESTION = "Write a queue class."
WEATHER_INPUT = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_INPUT}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER_INPUT},
}
EVENT_ORDER = ["message_start", "ping", "content_block_start"]
# The newer `anthropic` SDKs have no `temperature`, `top_p` or `top_k` arguments; Conveyor takes them: sent as extra
# fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def locked(tiny_model: Path) -> Iterator[Server]:
    server = start_server(tiny_model, "--api-key", KEY, "--max-total-tokens", "512")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(locked: Server) -> Iterator[anthropic.Anthropic]:
    """The SDK sends the key as `x-api-key`, and `anthropic-version`."""
    with anthropic.Anthropic(base_url=locked.url, api_key=KEY, max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def document(locked: Server) -> dict:
    return httpx.get(f"{locked.url}/openapi.json").json()


def check(document: dict, name: str, instance: object) -> None:
    jsonschema.validate(instance, {"$ref": f"#/components/schemas/{name}", "components": document["components"]})


def chat(server: Server, messages: list[dict], **fields) -> dict:
    """The same conversation through /v1/chat/completions, greedy."""
    body = {"model": "demo", "messages": messages, "temperature": 0, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def text_of(content: list) -> str:
    return "".join(block.text for block in content if block.type == "text")


def test_a_message_is_the_chat_routes_greedy_text(client: anthropic.Anthropic, locked: Server, document: dict) -> None:
    created = client.messages.create(
        model="demo", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, extra_body=GREEDY
    )
    expected = chat(
        locked, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], max_tokens=12
    )
    choice = expected["choices"][0]
    assert created.type == "message" and created.role == "assistant" and created.id.startswith("msg_")
    assert text_of(created.content) == choice["message"]["content"]
    assert created.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert created.usage.output_tokens == expected["usage"]["completion_tokens"]
    prompt = created.usage.input_tokens + created.usage.cache_read_input_tokens
    assert prompt == expected["usage"]["prompt_tokens"]
    check(document, "AnthropicMessage", created.model_dump(exclude_unset=True))  # as the server sent it
    # The system prompt as text blocks and the question as a text block are the same conversation.
    blocks = client.messages.create(
        model="demo",
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    assert text_of(blocks.content) == text_of(created.content)


def sse(server: Server, body: dict) -> list[tuple[str, dict]]:
    """A stream's events as sent: each `event:` name and its data (the SDK's iterator drops pings)."""
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    data = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in data] == names
    return list(zip(names, data))


def test_a_stream_sends_anthropics_events_and_the_same_text(
    client: anthropic.Anthropic, locked: Server, document: dict
) -> None:
    request = dict(model="demo", messages=[{"role": "user", "content": QUESTION}], max_tokens=10)
    whole = client.messages.create(**request, extra_body=GREEDY)
    events = sse(locked, {**request, **GREEDY, "stream": True})
    kinds = [kind for kind, _ in events]
    assert kinds[:3] == EVENT_ORDER and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == text_of(whole.content)
    start, end = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert (
        end["delta"]["stop_reason"] == whole.stop_reason and end["usage"]["output_tokens"] == whole.usage.output_tokens
    )
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert (
        start["usage"]["input_tokens"]
        == prompt
        == end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]
    )
    for _, data in events:
        check(document, "MessageStreamEvent", data)
    check(document, "AnthropicMessage", start)
    # The SDK's own accumulation rebuilds the same message.
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert text_of(final.content) == text_of(whole.content) and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


def test_stop_reasons(client: anthropic.Anthropic) -> None:
    request = dict(model="demo", messages=[{"role": "user", "content": "def add(a, b):"}], extra_body=GREEDY)
    long = client.messages.create(**request, max_tokens=20)
    text = text_of(long.content)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 20
    short = client.messages.create(**request, max_tokens=3)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    assert text.startswith(text_of(short.content))
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = client.messages.create(**request, max_tokens=20, stop_sequences=["<never there>", stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    kept = text_of(stopped.content)
    assert stop in kept and text.startswith(kept)  # the text keeps the stop sequence, as on every route


def test_a_forced_tool_is_used_with_input_that_fits_its_schema(client: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.messages.create(
        model="demo",
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=60,
        extra_body=GREEDY,
    )
    (call,) = [block for block in named.content if block.type == "tool_use"]
    assert named.stop_reason == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER_INPUT)
    # `any`, streamed: the input arrives in input_json_delta pieces.
    events = list(
        client.messages.create(
            model="demo",
            messages=question,
            tools=[WEATHER],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            max_tokens=60,
            extra_body=GREEDY,
            stream=True,
        )
    )
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert [b.type for b in starts] == ["tool_use"] and starts[0].name == "get_weather"
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_INPUT)
    assert events[-2].delta.stop_reason == "tool_use"


def test_a_tool_result_turn_and_count_tokens(client: anthropic.Anthropic, locked: Server, document: dict) -> None:
    """A conversation with a call and its result is the chat route's conversation with a tool message: the same
    greedy text, and count_tokens counts the prompt either route runs."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "unit": "C"}}
    result = {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "18 degrees"}]}
    messages = [question, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    answer = client.messages.create(
        model="demo", messages=messages, tools=[WEATHER], max_tokens=8, extra_body=GREEDY, system=SYSTEM
    )
    chat_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
    }
    expected = chat(
        locked,
        [
            {"role": "system", "content": SYSTEM},
            question,
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        ],
        tools=[CHAT_WEATHER],
        max_tokens=8,
    )
    assert text_of(answer.content) == expected["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model="demo", messages=messages, tools=[WEATHER], system=SYSTEM)
    assert counted.input_tokens == expected["usage"]["prompt_tokens"]
    assert counted.input_tokens == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    check(document, "MessageTokensCount", counted.model_dump())


def test_the_key_comes_as_x_api_key_or_bearer(locked: Server, document: dict) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    url = f"{locked.url}/v1/messages"
    with anthropic.Anthropic(base_url=locked.url, auth_token=KEY, max_retries=0, timeout=120) as bearer:
        assert bearer.messages.create(**body).usage.output_tokens == 2
    with (
        anthropic.Anthropic(base_url=locked.url, api_key="wrong-key", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError),
    ):
        wrong.messages.create(**body)
    for headers in ({}, {"x-api-key": "wrong-key"}, {"x-api-key": KEY[:-1]}):
        refused = httpx.post(url, json=body, headers={"anthropic-version": "2023-06-01", **headers})
        assert refused.status_code == 401
        assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
        check(document, "AnthropicError", refused.json())
    counted = httpx.post(f"{url}/count_tokens", json={"messages": body["messages"]}, headers={"x-api-key": KEY})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


BAD = [
    ({"messages": [{"role": "user", "content": "x"}]}, "`max_tokens`: missing field"),
    ({"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}, "`messages.0.role`"),
    ({"max_tokens": 2, "messages": []}, "`messages`"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, "`max_tokens`"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "last"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "needs"),
    ({"max_tokens": 10_000, "messages": [{"role": "user", "content": "x"}]}, "max_total_tokens"),
]


@pytest.mark.parametrize(("body", "words"), BAD, ids=[words for _, words in BAD])
def test_bad_requests_are_400_in_anthropics_shape(locked: Server, document: dict, body: dict, words: str) -> None:
    refused = httpx.post(f"{locked.url}/v1/messages", json=body, headers={"x-api-key": KEY})
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"] and error["error_type"] == "validation"
    check(document, "AnthropicError", error)


def outcomes(server: Server) -> dict[str, float]:
    """conveyor_requests_total by outcome."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^conveyor_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_refusals_and_hang_ups_are_counted_and_a_hang_up_cancels(locked: Server) -> None:
    """A 400 counts as the validation refusal it is; a client that hangs up mid-stream cancels its request (the
    shards are paused meanwhile, so it cannot finish first) and leaves nothing in flight."""
    before = outcomes(locked)
    refused = httpx.post(f"{locked.url}/v1/messages", json={"messages": []}, headers={"x-api-key": KEY})
    assert refused.status_code == 400 and outcomes(locked)["validation"] == before.get("validation", 0) + 1
    body = {"model": "demo", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 400, "stream": True}
    url, headers = f"{locked.url}/v1/messages", {"x-api-key": KEY}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
        deltas = 0
        for line in response.iter_lines():
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break
        with locked.shards_paused():
            response.close()
            cancelled = before.get("cancelled", 0) + 1
            wait_for(lambda: outcomes(locked).get("cancelled", 0) == cancelled, 60, "the request to be cancelled")
    listed = httpx.get(f"{locked.url}/v1/requests", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert listed.status_code == 200 and listed.json()["data"] == []


def test_the_sdk_raises_bad_request_and_not_found(client: anthropic.Anthropic, locked: Server) -> None:
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="demo", messages=[], max_tokens=2)
    missing = httpx.post(f"{locked.url}/v1/messages/nothing", json={}, headers={"x-api-key": KEY})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


class _Sink:
    """An SSE response's stand-in: the events written to it."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    async def write(self, data: bytes) -> None:
        kind, payload = data.decode().strip().split("\n")
        self.events.append(json.loads(payload.removeprefix("data: ")))
        assert kind == f"event: {self.events[-1]['type']}"


async def test_reasoning_becomes_a_thinking_block_streamed_or_not() -> None:
    """No server (the tiny model does not reason): the output of a model whose prompt opened a <think> block, read
    by the chat route's reader, as Anthropic's blocks and events."""
    text, pieces = "plan it</think>the answer", ["pl", "an it</th", "ink>the", " answer"]
    output = ChatOutput(None, Reasoning("inside"))
    finished = Finished(text, "eos_token", generated_tokens=4, seed=None)
    whole = content_of(output.parse(text))
    assert whole == [
        {"type": "thinking", "thinking": "plan it", "signature": ""},
        {"type": "text", "text": "the answer"},
    ]
    sink = _Sink()
    out = MessageEvents(sink, message("msg_1", "demo", [], (None, None), usage(7, 0, 0)))  # type: ignore[arg-type]
    await out.start()
    reader = output.fresh()
    for piece in pieces:
        for delta in reader.feed(piece):
            await out.piece(delta)
    for delta in reader.finish():
        await out.piece(delta)
    await out.finish(stop_of(finished, (), reader.called, reader.whole()), usage(7, 4, 3))
    kinds = [e["type"] for e in sink.events]
    assert kinds[:3] == EVENT_ORDER and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in sink.events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"] and kinds.count("content_block_stop") == 2
    deltas = [e["delta"] for e in sink.events if e["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == "plan it"
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "the answer"
    assert sink.events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert sink.events[-2]["usage"] == {
        "input_tokens": 4,
        "output_tokens": 4,
        "cache_read_input_tokens": 3,
        "cache_creation_input_tokens": 0,
    }


def test_the_schema_maps_thinking_and_refuses_what_is_not_served() -> None:
    from conveyor.router.api.base import ValidationError
    from conveyor.router.frontends.anthropic_routes import chat_body

    user = [{"role": "user", "content": "x"}]
    body = parse(api.MessagesRequest, {"max_tokens": 2, "messages": user, "thinking": {"type": "disabled"}})
    assert chat_body(body)["chat_template_kwargs"] == {"enable_thinking": False}
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}  # not fetched
    for refused in (
        {"max_tokens": 2, "messages": [{"role": "user", "content": [image]}]},
        {"max_tokens": 2, "messages": user, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"max_tokens": 2, "messages": user, "mcp_servers": []},
        {"max_tokens": 2, "messages": user, "service_tier": "priority"},
    ):
        with pytest.raises(ValidationError):
            parse(api.MessagesRequest, refused)
