"""OpenAI's Responses API through the real processes, driven by the unmodified `openai` SDK: text, a function tool
and a JSON schema, created and streamed; a conversation continued by `previous_response_id`; the store's GET and
DELETE; what is refused. On the session's tiny-model deployment (random weights: the text is gibberish, so tools
and schemas are forced by their grammars, which is what makes their output checkable)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from conftest import Server
from pydantic import BaseModel, Field

from conveyor.router.api import responses_api as api
from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.core.events import Finished
from conveyor.router.frontends.responses_api_output import ResponseObject, whole_output
from conveyor.router.frontends.responses_api_routes import chat_body, messages_of
from conveyor.router.pipeline.chat_output import ChatOutput
from conveyor.router.pipeline.openai_requests import Choice
from conveyor.router.pipeline.tools import tool_use

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "rank": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "rank"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: Annotated[str, Field(max_length=10)]
    rank: Annotated[int, Field(ge=0, le=99)]


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def test_text_matches_the_chat_route(client: openai.OpenAI) -> None:
    """A Responses request is the chat it describes: greedy, the same text as /v1/chat/completions gives."""
    response = client.responses.create(
        model="demo", instructions="Be brief.", input="Write a queue class.", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a queue class."}],
        max_tokens=12,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"  # the item the limit cut


def test_a_required_function_tool_is_called_with_arguments_that_fit(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="demo", input="Weather in Paris?", tools=[WEATHER], tool_choice="required", max_output_tokens=60
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_streamed_function_call_arrives_in_argument_pieces(client: openai.OpenAI) -> None:
    """Greedy, so that it writes the same string every time (sampled, it once wrote the ordinary EOS id the test
    model declares inside the string: issue 60, `test_a_forced_call_goes_on_past_an_eos_id_in_its_json`)."""
    kinds: list[str] = []
    with client.responses.stream(
        model="demo",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_forced_call_goes_on_past_an_eos_id_in_its_json(client: openai.OpenAI, text_eos: str) -> None:
    """Issue 60: a streamed forced call ended `response.completed` with arguments `{"city": ") >=`, cut where the
    model sampled, inside the string, the ordinary token the test model declares as an EOS id. Here the grammar
    writes that token's text four times as the argument (llguidance forces it as the token itself), created and
    streamed: the grammar reads the EOS id as text there, and the call ends when its JSON is whole."""
    parameters = {"type": "object", "properties": {"op": {"const": text_eos * 4}}, "required": ["op"]}
    tool = {"type": "function", "name": "compare", "parameters": parameters}
    named = {"type": "function", "name": "compare"}
    forced = dict(
        model="demo", input="Compare them.", tools=[tool], tool_choice=named, temperature=0, max_output_tokens=40
    )
    created = client.responses.create(**forced)
    with client.responses.stream(**forced) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    for response in (created, streamed):
        (call,) = response.output
        assert response.status == "completed" and call.status == "completed"
        assert json.loads(call.arguments) == {"op": text_eos * 4}


CUT_SHORT = [  # how an output ended, its text, and why the response is incomplete (None: it is not)
    ("eos_token", '{"city": "Paris"}', None),
    ("eos_token", '{"city": ") >=', "stop"),
    ("stop_sequence", '{"city": ") >=', "stop"),
    ("length", '{"city": ") >=', "max_output_tokens"),
]


@pytest.mark.parametrize("choice", ["named", "required"])
@pytest.mark.parametrize(("reason", "arguments", "incomplete"), CUT_SHORT)
def test_a_call_whose_arguments_are_not_json_is_incomplete(
    choice: str, reason: str, arguments: str, incomplete: str | None
) -> None:
    """Whatever ends an output before a forced call's arguments are whole JSON, the call is not answered as made:
    the response and its item are incomplete, for `max_output_tokens` (the limit) or `stop` (any other end). No
    server: a forced call's grammar no longer ends early (`test_a_forced_call_goes_on_past_an_eos_id_in_its_json`),
    so the route's functions are given the outputs."""
    named = {"type": "function", "name": "get_weather"}
    body = parse(api.ResponsesRequest, {"input": "x", "tools": [WEATHER], "tool_choice": named})
    text = arguments
    if choice == "required":
        body = body.model_copy(update={"tool_choice": "required"})
        text = '[{"name": "get_weather", "arguments": ' + arguments + ("}]" if incomplete is None else "")
    output = ChatOutput(tool_use(parse(ChatRequest, chat_body(body, messages_of(body)))))
    finished = Finished(text, reason, generated_tokens=9, seed=None)
    items = whole_output(text, Choice(0, request=None, output=output), finished)  # type: ignore[arg-type]
    final = ResponseObject(body, "demo").json(items, "completed", None, finished)
    assert final["status"] == ("incomplete" if incomplete else "completed")
    assert final["incomplete_details"] == ({"reason": incomplete} if incomplete else None)
    assert [item["status"] for item in final["output"]] == [final["status"]]


def test_a_json_schema_shapes_the_text_created_and_streamed(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    response = client.responses.create(model="demo", input="A city?", text=fmt, max_output_tokens=60)
    jsonschema.validate(json.loads(response.output_text), CITY)
    with client.responses.stream(model="demo", input="A city?", text_format=City, max_output_tokens=120) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, City)


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, server: Server) -> None:
    first = client.responses.create(model="demo", input="def add(a, b):", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model="demo", input="and subtract?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    alone = client.responses.create(model="demo", input="and subtract?", max_output_tokens=6, temperature=0)
    # The second prompt holds the first turn (its input and output) before the new input.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    deleted = client.responses.with_raw_response.delete(first.id)  # the SDK's delete() returns None
    assert deleted.http_response.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    refused = httpx.post(
        f"{server.url}/v1/responses", json={"input": "x", "previous_response_id": first.id}, timeout=60
    )
    assert refused.status_code == 404 and "previous_response_id" in refused.json()["error"]["message"]


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="demo", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_reasoning_is_an_item_of_its_own_created_and_streamed(r1_chat_server: Server) -> None:
    """A model whose template opens a `<think>` block: what it writes before `</think>` is a reasoning item; a
    limit met inside the block leaves the response incomplete with the reasoning alone."""
    with openai.OpenAI(base_url=f"{r1_chat_server.url}/v1", api_key="x", max_retries=0, timeout=120) as sdk:
        response = sdk.responses.create(model="x", input="Two and two?", max_output_tokens=6, temperature=0)
        with sdk.responses.stream(model="x", input="Two and two?", max_output_tokens=6, temperature=0) as stream:
            events = list(stream)  # an incomplete response ends with `response.incomplete`, not `.completed`
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning"]
    assert final.output[0].type == "reasoning"
    thought = response.output[0].content[0].text
    assert thought and "think>" not in thought and response.output_text == ""
    assert "".join(deltas) == thought and [item.type for item in final.output] == ["reasoning"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("background", True), ("tools", [{"type": "web_search"}]), ("conversation", "conv_1"), ("bogus", 1)],
)
def test_what_is_not_implemented_is_refused_by_name(server: Server, field: str, value: object) -> None:
    response = httpx.post(f"{server.url}/v1/responses", json={"input": "x", field: value}, timeout=60)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["error_type"] == "validation" and field in body["error"]["message"]


@pytest.mark.parametrize(
    "metadata",
    [{f"k{n}": "v" for n in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}],
    ids=["17-pairs", "65-character-key", "513-character-value"],
)
def test_metadata_is_bounded_as_openai_bounds_it(server: Server, metadata: dict) -> None:
    """A stored response cannot carry megabytes of metadata (before, values were kept whole: 1.9 MB for one)."""
    response = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "metadata": metadata}, timeout=60)
    assert response.status_code == 422, response.text
    assert response.json()["error_type"] == "validation" and "metadata" in response.json()["error"]["message"]
    fits = {f"k{n}": "v" * 512 for n in range(16)}
    kept = httpx.post(f"{server.url}/v1/responses", json={"input": "x", "max_output_tokens": 1, "metadata": fits})
    assert kept.status_code == 200 and kept.json()["metadata"] == fits
