"""Speculative decoding, measured as the person chatting alone sees it: tokens per second and the wait per token,
with drafts and without, on the real model, beside llama.cpp's server with and without its own n-gram drafts.

Systems: Conveyor without drafts, with prompt-lookup drafts (chosen by what they earn, the default, and all of them at
every step, `--speculate-policy fixed`), and with the model drafting for itself quantized (`--speculate-model self
--speculate-quantize int4`); llama.cpp's server without and with its own n-gram drafts.
Two workloads of greedy chat requests, sent one at a time (and, to see where drafts stop paying, 4 at a time):
free chat answers, where prompt lookup rarely finds a match, and edits of a given code or text, where the
answer repeats most of the prompt. Conveyor is one deployment; each request asks `speculate: 0` (off) or leaves
the server's --speculate, so both are measured on the same processes in alternating rounds. Acceptance comes
from Conveyor's own counters (/metrics) over each cell.

    python -m benchmarks.speculation [--model-id real|demo|DIR] [--rounds 2] [--skip-llamacpp]

Reported per cell: output tok/s per stream (output tokens after the first over the time after the first),
TPOT (its inverse in ms), the median gap between streamed chunks (several tokens verified in one step arrive
together, so this gap is near 0 while TPOT is the honest wait per token), and the draft acceptance rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import deploy
from benchmarks.backends import ChatBackend, RequestOptions
from benchmarks.client import RequestRecord, send
from benchmarks.compare import resolve
from benchmarks.progress import note
from benchmarks.workload import Prompt

CODE = """def load_config(path):
    with open(path) as handle:
        data = json.load(handle)
    settings = {}
    for key, value in data.items():
        if key.startswith("_"):
            continue
        settings[key.lower()] = value
    return settings


def save_config(path, settings):
    with open(path, "w") as handle:
        json.dump(settings, handle, indent=2)
"""
TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to five "
    "books at a time for three weeks. Books that are returned late cost ten cents a day. The reading room on the "
    "second floor is quiet, and the children's corner on the first floor hosts a story hour every Saturday."
)
WORKLOADS = {
    "chat": [
        "Tell me about the history of the printing press.",
        "What are three tips for staying healthy?",
        "Explain how a rainbow forms.",
        "Write a short poem about autumn.",
        "Why is the sky blue?",
        "Give me a recipe for pancakes.",
    ],
    "edit": [
        "Rewrite this Python code, renaming the variable `settings` to `config`. Reply with the full code only."
        f"\n\n{CODE}",
        f"Add a docstring to each function of this code and return the whole code.\n\n{CODE}",
        f"Repeat this text, replacing 'library' with 'museum':\n\n{TEXT}",
        f"Copy this text and correct nothing, then add one sentence at the end:\n\n{TEXT}",
    ],
}


@dataclass
class Cell:
    """One system on one workload at one concurrency, over every round."""

    records: list[RequestRecord] = field(default_factory=list)
    drafted: float = 0.0
    accepted: float = 0.0

    def row(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.success and r.output_len > 1]
        rates = [(r.output_len - 1) / (r.e2el - r.ttft) for r in ok if r.e2el > r.ttft]
        gaps = [g for r in ok for g in r.itl]
        tok_s = statistics.mean(rates) if rates else 0.0
        return {
            "requests": len(self.records),
            "failed": sum(not r.success for r in self.records),
            "tok_s": round(tok_s, 1),
            "tpot_ms": round(1000 / tok_s, 1) if tok_s else None,
            "median_chunk_gap_ms": round(1000 * statistics.median(gaps), 1) if gaps else None,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
            "drafted": int(self.drafted),
        }


class Speculating(ChatBackend):
    """Chat completions with `speculate` set (0: drafts off for this request), or left to the server."""

    def __init__(self, speculate: int | None) -> None:
        self.speculate = speculate

    def body(self, prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        body = super().body(prompt, options)
        if self.speculate is not None:
            body["speculate"] = self.speculate
        return body


async def _metrics(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """Conveyor's draft counters (0, 0 for a server without them)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text() if response.status == 200 else ""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and value:
            values[name] = float(value)
    return (
        values.get("conveyor_speculative_drafted_tokens_total", 0.0),
        values.get("conveyor_speculative_accepted_tokens_total", 0.0),
    )


async def run_cell(
    url: str, model: str, backend: ChatBackend, texts: list[str], concurrency: int, max_tokens: int, cell: Cell
) -> None:
    prompts = [Prompt(i, text, 0, max_tokens, False) for i, text in enumerate(texts)]
    options = RequestOptions(model=model)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        before = await _metrics(session, url)
        gate = asyncio.Semaphore(concurrency)

        async def one(prompt: Prompt) -> RequestRecord:
            async with gate:
                return await send(session, url, backend, prompt, options)

        cell.records += await asyncio.gather(*(one(p) for p in prompts))
        after = await _metrics(session, url)
    cell.drafted += after[0] - before[0]
    cell.accepted += after[1] - before[1]


@contextlib.contextmanager
def servers(model_dir: Path, args: argparse.Namespace) -> Iterator[dict[str, tuple[str, ChatBackend]]]:
    """Every system, started together: Conveyor once (off and on by request), llama.cpp without and with drafts."""
    with contextlib.ExitStack() as stack:
        spec = deploy.ConveyorSpec("conveyor", model_dir, [f"--speculate={args.speculate}"])
        url = stack.enter_context(deploy.conveyor(spec, args.timeout))
        systems = {"conveyor-off": (url, Speculating(0)), "conveyor-ngram": (url, Speculating(None))}
        if args.fixed:
            flags = [f"--speculate={args.speculate}", "--speculate-policy=fixed"]
            fixed = stack.enter_context(
                deploy.conveyor(deploy.ConveyorSpec("conveyor-fixed", model_dir, flags), args.timeout)
            )
            systems["conveyor-ngram-fixed"] = (fixed, Speculating(None))
        if args.draft_quantize != "none":
            quantize = [] if args.draft_quantize == "float" else [f"--speculate-quantize={args.draft_quantize}"]
            flags = [f"--speculate={args.speculate}", "--speculate-model=self", *quantize]
            drafting = stack.enter_context(
                deploy.conveyor(deploy.ConveyorSpec("conveyor-draft", model_dir, flags), args.timeout)
            )
            systems[f"conveyor-draft-{args.draft_quantize}"] = (drafting, Speculating(None))
        if not args.skip_llamacpp and (problem := deploy.llamacpp_problem()) is None:
            context = 2048
            plain = stack.enter_context(deploy.llamacpp_serve(model_dir, "float32", 4, context, args.timeout))
            ngram = stack.enter_context(
                deploy.llamacpp_serve(model_dir, "float32", 4, context, args.timeout, LLAMACPP_NGRAM)
            )
            systems |= {"llama.cpp-off": (plain, ChatBackend()), "llama.cpp-ngram": (ngram, ChatBackend())}
        elif not args.skip_llamacpp:
            note(f"llama.cpp left out: {problem}")
        yield systems


# llama.cpp's own prompt lookup: match the last 3 tokens, draft up to 8 (its server's n-gram speculation).
LLAMACPP_NGRAM = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "8"]


def measure(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every cell, each system in turn within a round (the order reversed every other round, against drift)."""
    cells: dict[tuple[str, str, int], Cell] = {}
    with servers(model_dir, args) as systems:
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for workload, texts in WORKLOADS.items():
                    order = list(systems) if round_ % 2 == 0 else list(reversed(systems))
                    for name in order:
                        url, backend = systems[name]
                        note(f"round {round_ + 1}: {name}, {workload}, {concurrency} at a time")
                        cell = cells.setdefault((name, workload, concurrency), Cell())
                        request = (url, str(model_dir), backend, texts, concurrency, args.max_tokens, cell)
                        asyncio.run(run_cell(*request))
    return {f"{n}/{w}/{c}": cell.row() for (n, w, c), cell in cells.items()}


def print_table(results: dict[str, Any]) -> None:
    print("| system | workload | streams | tok/s per stream | TPOT (ms) | median chunk gap (ms) | acceptance |")
    print("|---|---|---|---|---|---|---|")
    for key, row in results.items():
        name, workload, concurrency = key.split("/")
        acceptance = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(
            f"| {name} | {workload} | {concurrency} | {row['tok_s']} | {row['tpot_ms']} | "
            f"{row['median_chunk_gap_ms']} | {acceptance} |"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="real", help="real (SmolLM2-135M-Instruct), demo, or a model directory")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--speculate", type=int, default=8, help="Conveyor's --speculate")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument(
        "--fixed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also Conveyor offering every request all its drafts at every step (--speculate-policy fixed), "
        "against the default, which offers the drafts that pay",
    )
    p.add_argument(
        "--draft-quantize",
        default="int4",
        choices=["int4", "int8", "float", "none"],
        help="also Conveyor with the model drafting for itself, quantized so (none: leave it out)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--json", type=Path, help="also write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = measure(resolve(args.model_id, "small"), args)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
