"""Reasoning through the server with the unmodified `openai` SDK, streamed and not: `reasoning_content` apart from
`content`, on a Qwen3-shaped model (the model opens the `<think>` block; `enable_thinking: false` closes it in the
prompt) and a DeepSeek-R1-shaped one (the prompt opens it), both found to reason from their templates alone.

Random weights never close a block on their own: a regex whose text writes the block (`...</think>...`) shapes the
whole output (a constraint that does not is applied after the block), so the real server writes a block and an
answer for the parser to split. The token limit met inside the block needs no such help.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from conftest import Server

MESSAGES = [{"role": "user", "content": "What is two and two?"}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
THOUGHT, ANSWER = "[a-z][a-z ]{0,19}", "[A-Z][a-z ]{0,19}"


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _answer(server: Server, stream: bool, **request) -> dict:
    """The choice's reasoning, content, calls and finish reason, from the message or the stream's deltas."""
    request = {"model": "x", "messages": MESSAGES, "temperature": 0, **request}
    client = _client(server)
    if not stream:
        completion = client.chat.completions.create(**request)
        choice = completion.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return {
            "reasoning": (choice.message.model_extra or {}).get("reasoning_content"),
            "content": choice.message.content,
            "calls": calls,
            "finish": choice.finish_reason,
            "prompt_tokens": completion.usage.prompt_tokens,
        }
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                name, arguments = calls.get(piece.index, (piece.function.name, ""))
                calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
        prompt_tokens = chunk.usage.prompt_tokens if chunk.usage else None
    return {
        "reasoning": reasoning or None,
        "content": content or None,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
        "prompt_tokens": prompt_tokens,
    }


def _regex(pattern: str) -> dict:
    return {"structured_outputs": {"regex": pattern}}


@STREAM
def test_a_block_the_model_opens_is_reasoning(qwen3_chat_server: Server, stream: bool) -> None:
    answer = _answer(
        qwen3_chat_server, stream, max_tokens=80, extra_body=_regex(f"<think>{THOUGHT}</think>\n\n{ANSWER}")
    )
    assert re.fullmatch(THOUGHT, answer["reasoning"]) and re.fullmatch(ANSWER, answer["content"])
    assert answer["finish"] == "stop" and "think>" not in answer["reasoning"] + answer["content"]


@STREAM
def test_a_block_the_prompt_opens_is_reasoning(r1_chat_server: Server, stream: bool) -> None:
    answer = _answer(r1_chat_server, stream, max_tokens=80, extra_body=_regex(f"{THOUGHT}</think>\n\n{ANSWER}"))
    assert re.fullmatch(THOUGHT, answer["reasoning"]) and re.fullmatch(ANSWER, answer["content"])
    assert answer["finish"] == "stop"


def test_streamed_and_whole_agree(qwen3_chat_server: Server, r1_chat_server: Server) -> None:
    for server, pattern in ((qwen3_chat_server, f"<think>{THOUGHT}</think>{ANSWER}"), (r1_chat_server, "")):
        extra = _regex(pattern) if pattern else {}
        whole, streamed = (_answer(server, s, max_tokens=24, extra_body=extra) for s in (False, True))
        assert whole == streamed


@STREAM
def test_the_token_limit_met_inside_the_block(r1_chat_server: Server, stream: bool) -> None:
    answer = _answer(r1_chat_server, stream, max_tokens=12, extra_body={"ignore_eos": True})
    assert answer["reasoning"] and answer["content"] is None and answer["finish"] == "length"


def test_enable_thinking_false_reaches_the_template(qwen3_chat_server: Server) -> None:
    """Qwen3's template closes an empty block in the prompt: the prompt is longer, and the output is all answer
    (even text that looks like a block)."""
    pattern = f"<think>{THOUGHT}</think>{ANSWER}"
    thinking = _answer(qwen3_chat_server, False, max_tokens=80, extra_body=_regex(pattern))
    closed = _answer(
        qwen3_chat_server,
        False,
        max_tokens=80,
        extra_body={**_regex(pattern), "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert closed["prompt_tokens"] > thinking["prompt_tokens"]
    assert closed["reasoning"] is None and closed["content"].startswith("<think>")


@STREAM
def test_constraints_apply_after_the_block(r1_chat_server: Server, stream: bool) -> None:
    """A schema, or a forced call, constrains the answer: inside the block the model thinks freely, here until
    the token limit (so there is no answer yet)."""
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"},
    ):
        answer = _answer(r1_chat_server, stream, max_tokens=10, extra_body={"ignore_eos": True}, **extra)
        assert answer["reasoning"] and answer["content"] is None and not answer["calls"]
        assert answer["finish"] == "length"


@STREAM
def test_tool_calls_follow_the_reasoning(qwen3_chat_server: Server, stream: bool) -> None:
    call = '<tool_call>\n{"name": "ping", "arguments": {"n": 1}}\n</tool_call>'
    text = f"<think>i will ping</think>\n\nPinging.\n{call}"
    answer = _answer(
        qwen3_chat_server,
        stream,
        max_tokens=200,
        tools=[{"type": "function", "function": {"name": "ping"}}],
        extra_body={"structured_outputs": {"choice": [text]}},
    )
    assert (answer["reasoning"], answer["content"]) == ("i will ping", "Pinging.")
    assert answer["calls"] == [("ping", '{"n": 1}')] and answer["finish"] == "tool_calls"


def test_the_reasoning_goes_back_with_the_message(qwen3_chat_server: Server) -> None:
    """An assistant message sent back as the answer gave it (`reasoning_content` included) is taken, and the
    template renders the reasoning."""
    first = _client(qwen3_chat_server).chat.completions.create(
        model="x",
        messages=MESSAGES,
        max_tokens=80,
        temperature=0,
        extra_body=_regex(f"<think>{THOUGHT}</think>{ANSWER}"),
    )
    message = first.choices[0].message.model_dump(exclude_none=True)
    assert message["reasoning_content"]
    follow_up = [*MESSAGES, message, {"role": "user", "content": "Sure?"}]
    with_reasoning = _client(qwen3_chat_server).chat.completions.create(model="x", messages=follow_up, max_tokens=2)
    message.pop("reasoning_content")
    without = _client(qwen3_chat_server).chat.completions.create(
        model="x", messages=[*MESSAGES, message, follow_up[-1]], max_tokens=2
    )
    assert with_reasoning.usage.prompt_tokens > without.usage.prompt_tokens


@pytest.mark.parametrize(
    "kwargs",
    [
        {"add_generation_prompt": False},
        {"tools": []},
        {"tokenize": True},
        {"messages": []},
        {"bos_token": ""},
        {"note": "</s>"},
        {"nested": {"deep": ["<s>"]}},
    ],
    ids=["add_generation_prompt", "tools", "tokenize", "messages", "bos_token", "special-text", "nested-special"],
)
def test_chat_template_kwargs_that_would_clash_are_refused(qwen3_chat_server: Server, kwargs: dict) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": kwargs}
    r = httpx.post(f"{qwen3_chat_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert "chat_template_kwargs" in r.json()["error"]["message"]
