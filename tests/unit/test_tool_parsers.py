"""Each family's tool-call parser (router/pipeline/tool_parsers/) on the output shapes that family's models write:
one call, parallel calls, text then calls, broken JSON and names that are no tool (content, nothing lost), a call
cut short; the same output streamed one to three characters at a time adds up to the whole answer's reading, with
no marker in the content; the forced modes; and the choice of a family from a model's template."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from conveyor import config
from conveyor.router.api.base import parse
from conveyor.router.api.openai import ChatRequest
from conveyor.router.pipeline.chat_output import ChatDelta, ChatOutput, Parsed
from conveyor.router.pipeline.reasoning import REASONING_PARSERS
from conveyor.router.pipeline.tool_parsers.json_scan import ValueScanner
from conveyor.router.pipeline.tool_parsers.registry import FALLBACK, FORMATS, choose_tool_format
from conveyor.router.pipeline.tools import tool_use

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object"}}}
PARIS = '{"city": "Paris", "unit": "C"}'
SEVEN = '{"hour": 7, "loud": false, "note": "a } and a \\" inside"}'
W, A = f'{{"name": "get_weather", "arguments": {PARIS}}}', f'{{"name": "set_alarm", "arguments": {SEVEN}}}'
LW, LA = W.replace('"arguments"', '"parameters"'), A.replace('"arguments"', '"parameters"')  # Llama's key
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call|>", "<|/tool_call|>")


def _use(**fields: Any) -> Any:
    return tool_use(
        parse(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, ALARM], **fields})
    )


AUTO = _use()


def _calls(parsed: Parsed) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.calls]


def _streamed(output: ChatOutput, text: str, seed: int = 0) -> list[ChatDelta]:
    """`text` fed one to three characters at a time."""
    rng, deltas, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 3)
        deltas += output.feed(text[at : at + step])
        at += step
    return deltas + output.finish()


# Per family: (output, content, calls) as the whole answer reads.
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, str]]]]] = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>', None, [("get_weather", PARIS)]),
        (
            f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>\n'
            f'<tool_call>{{"name": "set_alarm", "arguments": {SEVEN}}}</tool_call>',
            None,
            [("get_weather", PARIS), ("set_alarm", SEVEN)],
        ),
        (
            f'Let me check.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
            "Let me check.",
            [("get_weather", PARIS)],
        ),
        ("Hi <tool_call>not JSON</tool_call> there", "Hi <tool_call>not JSON</tool_call> there", []),
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            [],
        ),
        ('then <tool_call>{"name": "get_weather", "arg', 'then <tool_call>{"name": "get_weather", "arg', []),
        (
            '<tool_call>{"name": ["x"], "arguments": {}}</tool_call>',
            '<tool_call>{"name": ["x"], "arguments": {}}</tool_call>',
            [],
        ),
        (f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}', None, [("get_weather", PARIS)]),  # unclosed
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
        (
            f"<|python_tag|>{LW}; {LA}",
            None,
            [("get_weather", PARIS), ("set_alarm", SEVEN)],
        ),
        (
            f'I will look it up. <|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}',
            "I will look it up.",
            [("get_weather", PARIS)],
        ),
        ('{"name": "get_weather", "parameters": {"city": }}', '{"name": "get_weather", "parameters": {"city": }}', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call: content
        ("The weather is fine {honestly}.", "The weather is fine {honestly}.", []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]', None, [("get_weather", PARIS)]),
        (
            f"[TOOL_CALLS] [{W}, {A}]",
            None,
            [("get_weather", PARIS), ("set_alarm", SEVEN)],
        ),
        (
            f'Checking the forecast. [TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]',
            "Checking the forecast.",
            [("get_weather", PARIS)],
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"]',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"]',
            [],
        ),
        ("[TOOL_CALLS] no list", "[TOOL_CALLS] no list", []),
    ],
    "phi4_mini_json": [
        (
            f'<|tool_call|>[{{"name": "get_weather", "arguments": {PARIS}}}]<|/tool_call|>',
            None,
            [("get_weather", PARIS)],
        ),
        (
            f"<|tool_call|>[{W}, {A}]",
            None,
            [("get_weather", PARIS), ("set_alarm", SEVEN)],
        ),
        (
            f'Sure.\n<|tool_call|>{{"name": "get_weather", "arguments": {PARIS}}}<|/tool_call|>',
            "Sure.",
            [("get_weather", PARIS)],
        ),
        (f'functools[{{"name": "set_alarm", "arguments": {SEVEN}}}]', None, [("set_alarm", SEVEN)]),
        ("import functools\nfunctools.reduce(f, xs)", "import functools\nfunctools.reduce(f, xs)", []),
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {]<|/tool_call|>',
            '<|tool_call|>[{"name": "get_weather", "arguments": {]<|/tool_call|>',
            [],
        ),
    ],
}
# Broken JSON after a call's name: read whole, content; streamed, the call was begun before the break (below).
BREAKS_AFTER_NAME = {
    '{"name": "get_weather", "parameters": {"city": }}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"]',
    '<|tool_call|>[{"name": "get_weather", "arguments": {]<|/tool_call|>',
}
FAMILY_CASES = [
    pytest.param(family, *case, id=f"{family}-{n}") for family, cases in CASES.items() for n, case in enumerate(cases)
]


@pytest.mark.parametrize(("family", "text", "content", "calls"), FAMILY_CASES)
def test_each_family_reads_its_own_output_whole(family: str, text: str, content: str | None, calls: list) -> None:
    parsed = ChatOutput(AUTO, family=FORMATS[family]).parse(text)
    assert (parsed.content, _calls(parsed)) == (content, calls)
    assert parsed.reasoning is None
    for call in parsed.calls:
        assert json.loads(call.arguments) is not None
        if family == "mistral":
            assert re.fullmatch("[A-Za-z0-9]{9}", call.id)
        else:
            assert re.fullmatch("call_[0-9a-f]{24}", call.id)


@pytest.mark.parametrize(("family", "text", "content", "calls"), FAMILY_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_pieces_add_up_to_the_whole_answer(
    family: str, text: str, content: str | None, calls: list, seed: int
) -> None:
    output = ChatOutput(AUTO, family=FORMATS[family])
    deltas = _streamed(output, text, seed)
    streamed = Parsed.of(deltas)
    if text in BREAKS_AFTER_NAME and streamed.calls:  # begun (if the name came before the break, in its own piece)
        (call,) = streamed.calls  # nothing lost: what follows the call's header is its arguments, then content
        assert call.name == "get_weather" and text.endswith(call.arguments + (streamed.content or ""))
        return
    assert (streamed.content, _calls(streamed)) == (content, calls)
    if calls:  # no marker leaks into content
        assert not any(marker in d.content for d in deltas for marker in MARKERS)
    # a call's first piece names it, with an id; the others only add arguments; calls come in index order
    firsts = [d for d in deltas if d.call_id is not None]
    assert [d.call_index for d in firsts] == list(range(len(calls)))
    assert all(d.call_name is None for d in deltas if d.is_call and d.call_id is None)


def test_a_call_streams_its_name_first_then_its_arguments_in_pieces() -> None:
    output = ChatOutput(AUTO)
    text = f'Sure. <tool_call>{{"name": "set_alarm", "arguments": {SEVEN}}}</tool_call>'
    deltas = [output.feed(text[i : i + 2]) for i in range(0, len(text), 2)] + [output.finish()]
    flat = [d for group in deltas for d in group]
    named = next(n for n, group in enumerate(deltas) if any(d.call_id for d in group))
    assert "".join(d.content for d in flat) == "Sure." and [d.call_name for d in flat if d.call_id] == ["set_alarm"]
    pieces = [d.arguments for d in flat if d.is_call]
    assert len([p for p in pieces if p]) > 5 and "".join(pieces) == SEVEN
    assert named < len(deltas) - 10  # named long before the call ends


def test_a_stream_cannot_take_back_a_call_it_began() -> None:
    """Streamed, a call whose name was sent keeps what was sent when its JSON breaks off later; the rest of the
    text is content. Whole, the same output is content."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"} oops}</tool_call> after'
    whole = ChatOutput(AUTO).parse(text)
    assert (whole.content, whole.calls) == (text, [])
    streamed = Parsed.of(_streamed(ChatOutput(AUTO), text))
    assert _calls(streamed) == [("get_weather", '{"city": "Paris"}')]
    assert streamed.content == " oops}</tool_call> after"
    cut = Parsed.of(_streamed(ChatOutput(AUTO), '<tool_call>{"name": "get_weather", "arguments": {"ci'))
    assert _calls(cut) == [("get_weather", '{"ci')] and cut.content is None  # the token limit met mid-call


def test_content_streams_until_a_call_may_start() -> None:
    output = ChatOutput(AUTO)
    assert [d.content for d in output.feed("Hi there <to")] == ["Hi there"]
    assert output.feed("ol") == []
    assert [d.content for d in output.feed(" maybe")] == [" <tool maybe"]
    assert [d.content for d in ChatOutput(None).feed("<tool_call>")] == ["<tool_call>"]  # no tools: plain text


def test_names_that_come_second_still_make_a_call() -> None:
    text = '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
    for parsed in (ChatOutput(AUTO).parse(text), Parsed.of(_streamed(ChatOutput(AUTO), text))):
        assert _calls(parsed) == [("get_weather", '{"city": "Rome"}')] and parsed.content is None


def test_forced_calls_read_the_grammar_s_json_whatever_the_family() -> None:
    required = _use(tool_choice="required")
    text = f'[{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "set_alarm", "arguments": {SEVEN}}}]'
    for family in FORMATS.values():
        for parsed in (
            ChatOutput(required, family=family).parse(text),
            Parsed.of(_streamed(ChatOutput(required, family=family), text)),
        ):
            assert _calls(parsed) == [("get_weather", PARIS), ("set_alarm", SEVEN)] and parsed.content is None
    assert ChatOutput(required).parse('[{"name": "get_weather", "argu').content == '[{"name": "get_weather", "argu'
    named = _use(tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    parsed = ChatOutput(named, family=FORMATS["mistral"]).parse(SEVEN)
    assert _calls(parsed) == [("set_alarm", SEVEN)] and re.fullmatch("[A-Za-z0-9]{9}", parsed.calls[0].id)
    deltas = _streamed(ChatOutput(named), SEVEN)
    assert deltas[0].call_name == "set_alarm" and "".join(d.arguments for d in deltas) == SEVEN


def test_value_scanner_finds_where_a_value_ends() -> None:
    for text, end in [('{"a": "}"}, x', 10), ("[1, [2]] y", 8), ('"a\\"b" c', 6)]:
        scanner = ValueScanner()
        for char in text:
            scanner.feed(char)
        assert scanner.end == end and not scanner.broken
    for text in ("{]", "x", "{}}"):
        scanner = ValueScanner()
        scanner.feed(text)
        assert scanner.broken or scanner.end == 2


# --- choosing a family ----------------------------------------------------------------------------------------

QWEN_TEMPLATE = '{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>\n{"name": <function-name>, ...}'
LLAMA_TEMPLATE = (
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
)
MISTRAL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]"
PHI_TEMPLATE = "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}"


@pytest.mark.parametrize(
    ("template", "model_type", "name"),
    [
        (QWEN_TEMPLATE, "qwen3", "hermes"),
        (LLAMA_TEMPLATE, "llama", "llama3_json"),
        ("{{ '<|python_tag|>' + tool_call.name }}", None, "llama3_json"),
        (MISTRAL_TEMPLATE, "mistral", "mistral"),
        (PHI_TEMPLATE, "phi3", "phi4_mini_json"),
        ("{{ messages }}", "mistral", "hermes"),  # no markers: the fallback, whatever the model type
        ("", None, "hermes"),
        (QWEN_TEMPLATE + LLAMA_TEMPLATE, "qwen3", "hermes"),  # two formats named: model_type breaks the tie
        (QWEN_TEMPLATE + LLAMA_TEMPLATE, None, "llama3_json"),
    ],
)
def test_the_family_comes_from_the_template(template: str, model_type: str | None, name: str) -> None:
    assert choose_tool_format(template, model_type).name == name


def test_the_flags_override_and_name_what_the_parsers_are() -> None:
    assert choose_tool_format(QWEN_TEMPLATE, "qwen3", override="mistral").name == "mistral"
    assert FALLBACK.name == "hermes"
    choices = {a.dest: a.choices for a in config.parser("x")._actions}
    assert tuple(choices["tool_call_parser"]) == tuple(sorted(FORMATS))
    assert set(choices["reasoning_parser"]) == {*REASONING_PARSERS, "none"}
