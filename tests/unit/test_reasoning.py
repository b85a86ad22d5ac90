"""Reasoning apart from the answer (router/pipeline/reasoning.py, chat_output.py): a `<think>` block the model
opens or its prompt opened, the token limit met inside it, tool calls read after it only, streamed as whole; where a
request's output starts, from its prompt; and the choice of the parsers from a model (output_parsers.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.pipeline.chat_output import ChatDelta, ChatOutput, Parsed
from conveyor.router.pipeline.output_parsers import OutputParsers, output_parsers
from conveyor.router.pipeline.reasoning import Reasoning
from conveyor.router.pipeline.tools import tool_use

FREE, INSIDE, CLOSED = Reasoning("free"), Reasoning("inside"), Reasoning("closed")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOLS = tool_use(parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _streamed(output: ChatOutput, text: str, seed: int = 0) -> list[ChatDelta]:
    rng, deltas, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 3)
        deltas += output.feed(text[at : at + step])
        at += step
    return deltas + output.finish()


def _read(parsed: Parsed) -> tuple:
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls]


CASES = [
    pytest.param(
        FREE,
        "<think>\nLet me think.\nOr not.\n</think>\n\nIt is 4.",
        ("Let me think.\nOr not.", "It is 4.", []),
        id="qwen3",
    ),
    pytest.param(FREE, "It is 4.", (None, "It is 4.", []), id="no-block"),
    pytest.param(FREE, "  <think>a</think>b", ("a", "b", []), id="space-before"),
    pytest.param(
        FREE, "<think>\nstill thinking when the tokens ran", ("still thinking when the tokens ran", None, []), id="cut"
    ),
    pytest.param(FREE, "<thinking is a word", (None, "<thinking is a word", []), id="not-a-tag"),
    pytest.param(INSIDE, "\nThe prompt opened it.\n</think>\n\nYes.", ("The prompt opened it.", "Yes.", []), id="r1"),
    pytest.param(INSIDE, "cut short", ("cut short", None, []), id="r1-cut"),
    pytest.param(CLOSED, "<think>x</think>y", (None, "<think>x</think>y", []), id="closed"),
]


@pytest.mark.parametrize(("reasoning", "text", "expected"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_reasoning_comes_apart_from_the_answer(reasoning: Reasoning, text: str, expected: tuple, seed: int) -> None:
    assert _read(ChatOutput(None, reasoning).parse(text)) == expected
    deltas = _streamed(ChatOutput(None, reasoning), text, seed)
    assert _read(Parsed.of(deltas)) == expected
    assert not any("think>" in d.content + d.reasoning for d in deltas if expected[0] is not None)


def test_reasoning_streams_before_the_answer() -> None:
    output = ChatOutput(None, FREE)
    assert output.feed("<thi") == [] and output.feed("nk>Hmm") == [ChatDelta(reasoning="Hmm")]
    assert output.feed(", so </th") == [ChatDelta(reasoning=", so")]
    assert output.feed("ink>\n\nFour") == [ChatDelta(content="Four")]
    assert output.finish() == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_calls_are_read_after_the_reasoning_only(seed: int) -> None:
    text = f"<think>I could write {CALL} here, but I only think it.</think>\n\nChecking.\n{CALL}"
    expected = (f"I could write {CALL} here, but I only think it.", "Checking.", [("get_weather", '{"city": "Oslo"}')])
    assert _read(ChatOutput(TOOLS, FREE).parse(text)) == expected
    assert _read(Parsed.of(_streamed(ChatOutput(TOOLS, FREE), text, seed))) == expected
    cut = ChatOutput(TOOLS, FREE).parse(f"<think>about to call {CALL[:20]}")
    assert _read(cut) == (f"about to call {CALL[:20]}", None, [])


@pytest.mark.parametrize(
    ("prompt", "start"),
    [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "free"),
        ("<|im_start|>assistant\n<think>\n", "inside"),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
        ("user: what is <think>?\nassistant:", "free"),
    ],
)
def test_where_the_output_starts_comes_from_the_prompt(prompt: str, start: str) -> None:
    assert Reasoning.of_prompt(prompt).start == start


QWEN3_TEMPLATE = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"


def _model(tmp_path: Path, model_type: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_the_parsers_come_from_the_model_unless_the_flags_say(tmp_path: Path) -> None:
    qwen3 = SimpleNamespace(chat_template=QWEN3_TEMPLATE + "<tool_call>")
    parsers = output_parsers(_model(tmp_path, "qwen3"), qwen3)
    assert (parsers.tool_format.name, parsers.reasoning) == ("hermes", "qwen3")
    plain = output_parsers(None, SimpleNamespace(chat_template={"default": "[TOOL_CALLS]", "rag": "x"}))
    assert (plain.tool_format.name, plain.reasoning) == ("mistral", None)
    assert output_parsers(None, qwen3, reasoning_parser="none").reasoning is None
    assert output_parsers(None, SimpleNamespace(), "llama3_json", "deepseek_r1").reasoning == "deepseek_r1"
    assert output_parsers(None, SimpleNamespace(), "llama3_json").tool_format.name == "llama3_json"
    assert OutputParsers().reasoning_of("<think>") is None
    assert OutputParsers(reasoning="qwen3").reasoning_of("<think>") == INSIDE
