"""What the front door costs per request: a fixed corpus of TGI and OpenAI request bodies, each turned into
Conveyor's internal request(s) as the HTTP routes do it (JSON parsing, field checks, the chat template, tools,
tokenizing), in-process, with no server and no model.

    .venv/bin/python -m conveyor.benchmarks.validation                  # the demo `small` model's tokenizer
    .venv/bin/python -m conveyor.benchmarks.validation --model-id DIR --repeat 500

The corpus (`CORPUS`) is what stays fixed when the front door's code changes, so that a before and an after are
the same work; `front_door` is the one place that follows the code (which call turns which body into requests).
Each body is run once untimed (a grammar compiles once and is cached after; the first chat template renders
slower), then --repeat times, in rounds over the whole corpus in a shuffled order (seeded), so that a slow spell
of the machine, or what ran just before, weighs on every row alike; the table gives each body's median and the
corpus' mean of medians, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from conveyor.benchmarks.progress import note

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT = [
    {"role": "system", "content": "You write short Python functions."},
    {"role": "user", "content": "Write a queue class with push and pop."},
]

# name: (route, body). Routes: generate (TGI's /generate and /generate_stream), completions, chat.
CORPUS: dict[str, tuple[str, dict]] = {
    "tgi minimal": ("generate", {"inputs": PROMPT}),
    "tgi sampling": (
        "generate",
        {
            "inputs": PROMPT,
            "parameters": {
                "max_new_tokens": 64,
                "do_sample": True,
                "temperature": 0.7,
                "top_k": 50,
                "top_p": 0.9,
                "typical_p": 0.95,
                "repetition_penalty": 1.1,
                "frequency_penalty": 0.2,
                "presence_penalty": 0.1,
                "seed": 7,
                "stop": ["\n\n", "def "],
                "details": True,
                "top_n_tokens": 3,
                "truncate": 512,
            },
        },
    ),
    "tgi json grammar": (
        "generate",
        {"inputs": PROMPT, "parameters": {"max_new_tokens": 32, "grammar": {"type": "json", "value": SCHEMA}}},
    ),
    "tgi long prompt": ("generate", {"inputs": PROMPT * 40, "parameters": {"max_new_tokens": 16}}),
    "completions minimal": ("completions", {"model": "demo", "prompt": PROMPT}),
    "completions sampling": (
        "completions",
        {
            "model": "demo",
            "prompt": [PROMPT, PROMPT[::-1]],
            "max_tokens": 64,
            "temperature": 0.8,
            "top_p": 0.95,
            "n": 2,
            "seed": 3,
            "stop": ["\n\n"],
            "logprobs": 2,
            "frequency_penalty": 0.5,
        },
    ),
    "chat minimal": ("chat", {"model": "demo", "messages": CHAT}),
    "chat sampling": (
        "chat",
        {
            "model": "demo",
            "messages": CHAT,
            "max_tokens": 64,
            "temperature": 0.7,
            "top_p": 0.9,
            "logprobs": True,
            "top_logprobs": 2,
            "stop": ["```"],
            "seed": 11,
        },
    ),
    "chat json schema": (
        "chat",
        {
            "model": "demo",
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        },
    ),
    "chat tools": ("chat", {"model": "demo", "messages": CHAT, "tools": [WEATHER], "tool_choice": "auto"}),
}


def front_door(model_dir: Path) -> Callable[[str, bytes], object]:
    """A call from (route, raw body) to the internal request(s), as the routes make them (their request parsing,
    not their handlers: nothing is queued). The one place to change when the front door's code does."""
    from transformers import AutoTokenizer

    from conveyor.router.api.base import parse
    from conveyor.router.api.openai import ChatRequest, CompletionRequest
    from conveyor.router.frontends.openai import OpenAIRoutes
    from conveyor.router.limits import Limits
    from conveyor.router.pipeline.request import tgi_request
    from conveyor.router.pipeline.validation import Validation

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    validation = Validation(tokenizer, Limits(max_input_tokens=2047, max_total_tokens=2048), model_dir=str(model_dir))
    openai = OpenAIRoutes(None, validation, "demo")  # no inference: only its request parsing runs

    def call(route: str, raw: bytes) -> object:
        if route == "generate":
            return validation.validate(tgi_request(raw, stream=False))
        if route == "completions":
            return openai._completion_choices(parse(CompletionRequest, raw))
        return openai._chat_choices(parse(ChatRequest, raw))

    return call


def measure(model_dir: Path, repeat: int) -> dict[str, float]:
    """Each body's median microseconds over `repeat` rounds of the whole corpus."""
    call = front_door(model_dir)
    raws = {name: (route, json.dumps(body).encode()) for name, (route, body) in CORPUS.items()}
    for route, raw in raws.values():
        call(route, raw)  # untimed: compiles each grammar once, renders each template once
    times: dict[str, list[float]] = {name: [] for name in raws}
    order, shuffle = list(raws), random.Random(0).shuffle
    for round_ in range(repeat):
        if round_ % max(1, repeat // 4) == 0:
            note(f"round {round_ + 1}/{repeat}")
        shuffle(order)  # a body's place in the round (what ran before it) moved its time noticeably
        for name in order:
            route, raw = raws[name]
            start = time.perf_counter_ns()
            call(route, raw)
            times[name].append((time.perf_counter_ns() - start) / 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def table(medians: dict[str, float]) -> str:
    rows = [f"{'request':24s} {'route':12s} {'median us':>10s}"]
    rows += [f"{name:24s} {CORPUS[name][0]:12s} {us:10.1f}" for name, us in medians.items()]
    rows.append(f"{'mean of medians':24s} {'':12s} {statistics.mean(medians.values()):10.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    from conveyor.model_source import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", default="demo", help="a model directory, or demo (its tokenizer and chat template)")
    p.add_argument("--demo-size", default="small")
    p.add_argument("--repeat", type=int, default=200, help="timed rounds over the corpus")
    args = p.parse_args(argv)
    print(table(measure(resolve_model(args.model_id, args.demo_size), args.repeat)))


if __name__ == "__main__":
    main()
