"""Placement across shard groups: cache-aware against round-robin, two groups on one machine (`--replicas 2`),
the same model and the same multi-turn conversations.

    make bench-placement                                                  # runs this (also in make bench)
    .venv/bin/python -m benchmarks.placement                 # the real model, 3 rounds of both placements
    .venv/bin/python -m benchmarks.placement --model-id DIR --quick       # small and one round: the test's run

The workload is what a cache-aware placement is for: a few long system prompts (--systems of --system-len
tokens), many conversations each behind one of them, each of --turns turns whose prompt is the system prompt,
every earlier user message and the model's own answer to it (greedy, --answer-len tokens), then the new user
message. A conversation's next turn thus extends a prompt some group has cached, if it is sent there. --in-flight
conversations run at once, each sending its next turn when its last answer is in. Everything is seeded.

Each placement runs on a deployment of its own, started fresh for it (empty prefix caches), and the rounds
alternate the order (cache-aware, round-robin, round-robin, cache-aware, ...) against the VM's drift: every round
is reported and the median of each figure. Per run: the prefix cache's hit rate (prompt tokens found over prompt
tokens looked up, the difference of Conveyor's /metrics counters over the run, every group together), TTFT
(mean, p50, p99: the first streamed token of /v1/completions), output tokens per second over the run's wall time,
and the requests served. Results (summary.json, summary.md) go to --out; the Markdown also goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import deploy, real_model
from benchmarks.backends import CompletionsBackend, RequestOptions
from benchmarks.client import sse_data
from benchmarks.compare_report import machine, machine_line
from benchmarks.docs_tables import write_sitting
from benchmarks.metrics import Summary
from benchmarks.progress import note
from benchmarks.serve import load_tokenizer
from benchmarks.workload import Prompt, fit_tokens

PLACEMENTS = ("cache-aware", "round-robin")  # the launcher's --placement values (conveyor.config.PLACEMENTS)
REPLICAS = 2
RESULTS = Path(__file__).resolve().parent / "results" / "placement"
BENCHMARK = "placement"  # summary.json's mark, as long_context.py marks its own
FIGURES = ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "requests")
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Shape:
    """The workload's size and the number of rounds; --quick swaps the whole of it, a flag overrides one field."""

    systems: int = 4  # distinct system prompts
    system_len: int = 600  # tokens each
    conversations: int = 32
    turns: int = 4
    user_len: int = 32  # tokens of each user message
    answer_len: int = 32  # tokens of each answer (EOS ignored, so every run generates the same count)
    in_flight: int = 8  # conversations at once
    rounds: int = 3  # each a fresh deployment of each placement


FULL = Shape()
QUICK = Shape(systems=2, system_len=96, conversations=4, turns=3, user_len=12, answer_len=6, in_flight=2, rounds=1)


@dataclass(frozen=True)
class Conversation:
    index: int
    system: str  # the system prompt it sits behind
    users: list[str]  # the user's message of each turn


@dataclass
class Turn:
    """One request: when its first token came, what it generated (the next turn's prompt carries the text)."""

    conversation: int
    turn: int
    ttft_s: float = 0.0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None


@dataclass(frozen=True)
class Counters:
    """Conveyor's prefix-cache and placement counters at one moment, as /metrics shows them."""

    queries: float = 0.0  # prompt tokens looked up, every group together
    hits: float = 0.0  # of those, tokens found cached
    group_hits: dict[str, float] = field(default_factory=dict)  # by group index
    placed: dict[str, float] = field(default_factory=dict)  # by "group/reason"

    def minus(self, before: Counters) -> Counters:
        return Counters(
            self.queries - before.queries,
            self.hits - before.hits,
            {g: v - before.group_hits.get(g, 0.0) for g, v in self.group_hits.items()},
            {k: v - before.placed.get(k, 0.0) for k, v in self.placed.items()},
        )


@dataclass(frozen=True)
class RoundFigures:
    """One placement's run on one fresh deployment."""

    placement: str
    round: int
    requests: int  # answered
    failed: int
    hit_rate: float  # prompt tokens found in the prefix caches over those looked up
    hit_tokens: int
    query_tokens: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tok_s: float
    wall_s: float
    group_hit_tokens: dict[str, int]  # by group index
    placed: dict[str, int]  # requests placed, by "group/reason" (prefix, load or round_robin)


def build(shape: Shape, tokenizer: Any, seed: int) -> list[Conversation]:
    """The conversations, a pure function of the seed: system prompts and user messages from separate seeded word
    streams (no two share a block by chance), each conversation's system prompt drawn from a stream of its own."""
    systems = [
        fit_tokens(tokenizer, random.Random(f"system-{seed}-{i}"), shape.system_len)[0] for i in range(shape.systems)
    ]
    picks = random.Random(f"pick-{seed}")
    conversations = []
    for c in range(shape.conversations):
        users = [
            fit_tokens(tokenizer, random.Random(f"user-{seed}-{c}-{t}"), shape.user_len)[0] for t in range(shape.turns)
        ]
        conversations.append(Conversation(c, systems[picks.randrange(shape.systems)], users))
    return conversations


def prompt(conversation: Conversation, answers: list[str]) -> str:
    """The next turn's prompt: the previous one, its answer verbatim, and the next user message, so that it
    starts with exactly the text (and, token boundaries aside, the tokens) the group that served it has cached."""
    text = conversation.system
    for user, answer in zip(conversation.users, [*answers, None]):
        text += f"\n\nUser: {user}\nAssistant:"
        if answer is None:
            return text
        text += answer
    raise ValueError("every turn is answered already")


async def ask(session: aiohttp.ClientSession, url: str, model: str, text: str, max_tokens: int, turn: Turn) -> None:
    """One streamed greedy completion into `turn`: its TTFT (the first event that carries text), its text and the
    server's count of its tokens. The answer's text is needed for the next turn, which `client.send` does not keep."""
    backend = CompletionsBackend()
    body = backend.body(Prompt(turn.turn, text, 0, max_tokens, False), RequestOptions(model, ignore_eos=True))
    start, pieces, counted = time.perf_counter(), [], None
    try:
        async with session.post(url + backend.path, json=body) as response:
            if response.status != 200:
                turn.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return
            async for payload in sse_data(response.content):
                event = backend.read(json.loads(payload))
                if event.error is not None:
                    turn.error = event.error
                    return
                if event.token:
                    turn.ttft_s = turn.ttft_s or time.perf_counter() - start
                    pieces.append(event.text)
                counted = event.completion_tokens if event.completion_tokens is not None else counted
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return
    if not pieces:
        turn.error = "the stream ended without any content"
    turn.text, turn.output_tokens = "".join(pieces), len(pieces) if counted is None else counted


async def converse(
    session: aiohttp.ClientSession, url: str, model: str, conversation: Conversation, answer_len: int
) -> list[Turn]:
    """Every turn of one conversation in order; a failed turn ends it (the next would have no answer to carry)."""
    turns, answers = [], []
    for t in range(len(conversation.users)):
        turn = Turn(conversation.index, t)
        await ask(session, url, model, prompt(conversation, answers), answer_len, turn)
        turns.append(turn)
        if turn.error is not None:
            break
        answers.append(turn.text)
    return turns


async def warm_up(session: aiohttp.ClientSession, url: str, model: str, tokenizer: Any) -> None:
    """Short unrelated prompts, two per group at once, so each group's first forward is not a measured one: the
    cache-aware placement sends the second of two to the idle group, round-robin every other one."""
    rng = random.Random("placement-warm-up")
    texts = [fit_tokens(tokenizer, rng, 16)[0] for _ in range(2 * REPLICAS)]
    turns = [Turn(-1, i) for i in range(len(texts))]
    await asyncio.gather(*(ask(session, url, model, t, WARMUP_TOKENS, turn) for t, turn in zip(texts, turns)))
    if failed := [t.error for t in turns if t.error]:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


async def counters(session: aiohttp.ClientSession, url: str) -> Counters:
    """The prefix-cache and placement counters from /metrics (zero where the router has not counted yet)."""
    async with session.get(f"{url}/metrics") as response:
        response.raise_for_status()
        text = await response.text()
    values: dict[str, float] = {}
    group_hits: dict[str, float] = {}
    placed: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "conveyor_group_prefix_cache_hits_total":
                group_hits[sample.labels["group"]] = sample.value
            elif sample.name == "conveyor_placements_total":
                placed[f"{sample.labels['group']}/{sample.labels['reason']}"] = sample.value
            else:
                values[sample.name] = sample.value
    queries = values.get("conveyor_prefix_cache_queries_total", 0.0)
    return Counters(queries, values.get("conveyor_prefix_cache_hits_total", 0.0), group_hits, placed)


async def groups(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/info") as response:
        response.raise_for_status()
        return len((await response.json()).get("groups") or [])


async def drive(url: str, model: str, tokenizer: Any, work: list[Conversation], shape: Shape) -> dict[str, Any]:
    """The whole workload against one deployment: warm-up, then every conversation, --in-flight at once, with the
    counters read before and after (the warm-up's lookups are not the run's)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if (found := await groups(session, url)) != REPLICAS:
            raise RuntimeError(f"the deployment runs {found} shard groups, not {REPLICAS}")
        await warm_up(session, url, model, tokenizer)
        before = await counters(session, url)
        gate = asyncio.Semaphore(shape.in_flight)

        async def one(conversation: Conversation) -> list[Turn]:
            async with gate:
                return await converse(session, url, model, conversation, shape.answer_len)

        start = time.perf_counter()
        done = await asyncio.gather(*(one(c) for c in work))
        wall = time.perf_counter() - start
        after = await counters(session, url)
    return {"turns": [t for turns in done for t in turns], "wall_s": wall, "counters": after.minus(before)}


def figures(placement: str, round_: int, run: dict[str, Any]) -> RoundFigures:
    turns: list[Turn] = run["turns"]
    served = [t for t in turns if t.error is None]
    counted: Counters = run["counters"]
    ttft = Summary.of([t.ttft_s for t in served])
    return RoundFigures(
        placement=placement,
        round=round_,
        requests=len(served),
        failed=len(turns) - len(served),
        hit_rate=counted.hits / counted.queries if counted.queries else 0.0,
        hit_tokens=int(counted.hits),
        query_tokens=int(counted.queries),
        ttft_mean_ms=ttft.mean or 0.0,
        ttft_p50_ms=ttft.median or 0.0,
        ttft_p99_ms=ttft.p99 or 0.0,
        output_tok_s=sum(t.output_tokens for t in served) / run["wall_s"],
        wall_s=run["wall_s"],
        group_hit_tokens={g: int(v) for g, v in sorted(counted.group_hits.items())},
        placed={k: int(v) for k, v in sorted(counted.placed.items()) if v},
    )


def schedule(rounds: int) -> Iterator[tuple[int, str]]:
    """(round, placement) in running order: the order reversed every other round, so drift favours neither."""
    for round_ in range(1, rounds + 1):
        yield from ((round_, p) for p in (PLACEMENTS if round_ % 2 else PLACEMENTS[::-1]))


def measure(args: argparse.Namespace, tokenizer: Any, work: list[Conversation]) -> list[RoundFigures | dict]:
    """Every run, each on its own fresh deployment; a run that fails is reported and the others still run."""
    runs: list[RoundFigures | dict] = []
    for round_, placement in schedule(args.shape.rounds):
        note(f"placement: round {round_}, {placement}")
        flags = ["--replicas", str(REPLICAS), "--placement", placement, *args.launcher_arg]
        spec = deploy.ConveyorSpec(f"conveyor-{placement}", args.model_dir, flags)
        try:
            with deploy.conveyor(spec, args.startup_timeout) as url:
                run = asyncio.run(drive(url, str(args.model_dir), tokenizer, work, args.shape))
            runs.append(figures(placement, round_, run))
        except Exception as exc:  # noqa: BLE001 - one run's failure is reported; the others still run
            note(f"FAILED: round {round_}, {placement}: {exc}")
            runs.append({"placement": placement, "round": round_, "failed": str(exc)})
    return runs


def medians(runs: list[RoundFigures | dict]) -> dict[str, dict[str, float]]:
    """Each placement's median of each figure over its measured rounds."""
    out = {}
    for placement in PLACEMENTS:
        measured = [r for r in runs if isinstance(r, RoundFigures) and r.placement == placement]
        if measured:
            out[placement] = {f: statistics.median(getattr(r, f) for r in measured) for f in FIGURES}
    return out


def placement_of(run: RoundFigures | dict) -> str:
    return run.placement if isinstance(run, RoundFigures) else run["placement"]


def row(placement: str, label: str, f: dict[str, float]) -> str:
    return (
        f"| {placement} | {label} | {f['requests']:.0f} | {f['hit_rate']:.3f} | {f['ttft_mean_ms']:.0f} | "
        f"{f['ttft_p50_ms']:.0f} | {f['ttft_p99_ms']:.0f} | {f['output_tok_s']:.1f} |"
    )


def report(args: argparse.Namespace, runs: list[RoundFigures | dict]) -> str:
    shape = args.shape
    lines = [
        f"model: {args.model_dir.name}, {REPLICAS} shard groups (--replicas {REPLICAS})",
        machine_line(machine()),
        f"workload: {shape.conversations} conversations of {shape.turns} turns behind {shape.systems} system prompts "
        f"of ~{shape.system_len} tokens, {shape.user_len}-token user messages, {shape.answer_len}-token greedy "
        f"answers, {shape.in_flight} conversations in flight; a fresh deployment per run",
        "",
        "| placement | round | requests | hit rate | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | out tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    middle = medians(runs)
    for placement in PLACEMENTS:
        for run in (r for r in runs if placement_of(r) == placement):
            if isinstance(run, RoundFigures):
                lines.append(row(placement, str(run.round), asdict(run)))
            else:
                lines.append(f"| {placement} | {run['round']} | failed: {run['failed'][:200]} | | | | | |")
        if placement in middle:
            lines.append(row(placement, "median", middle[placement]))
    failed = sum(r.failed for r in runs if isinstance(r, RoundFigures))
    if failed:
        lines += ["", f"{failed} requests failed (their conversations ended there)"]
    return "\n".join(lines) + "\n"


def summary(args: argparse.Namespace, runs: list[RoundFigures | dict]) -> dict[str, Any]:
    return {
        "benchmark": BENCHMARK,
        "model": args.model_dir.name,
        "machine": machine(),
        "replicas": REPLICAS,
        "launcher_args": args.launcher_arg,
        "seed": args.seed,
        "workload": asdict(args.shape),
        "rounds": [asdict(r) if isinstance(r, RoundFigures) else r for r in runs],
        "median": medians(runs),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="real", help="'real' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--quick", action="store_true", help=f"a small workload and one round ({QUICK})")
    for f in fields(Shape):
        p.add_argument(
            f"--{f.name.replace('_', '-')}", type=int, default=None, help=f"default: {getattr(FULL, f.name)}"
        )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--launcher-arg", action="append", default=[], help="one more Conveyor launcher flag")
    p.add_argument(
        "--out", type=Path, default=None, help=f"a folder for summary.json and summary.md (default: {RESULTS}/MODEL)"
    )
    args = p.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(Shape) if getattr(args, f.name) is not None}
    args.shape = replace(QUICK if args.quick else FULL, **given)
    args.model_dir = real_model.prepare() if args.model_id == "real" else Path(args.model_id)
    args.out = args.out or RESULTS / args.model_dir.name
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = load_tokenizer(str(args.model_dir))
    work = build(args.shape, tokenizer, args.seed)
    runs = measure(args, tokenizer, work)
    text = report(args, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary(args, runs), indent=2) + "\n")
    write_sitting(args.out, "benchmarks.placement")
    (args.out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
