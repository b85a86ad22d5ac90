"""Structured output's cost: the token mask inside Conveyor's decode step, and the grammar engines side by side.

    make bench-grammar                                  # the demo `small` model, minutes on an idle 2-core CPU
    .venv/bin/python -m benchmarks.grammar --model-id DIR --batch-sizes 1,8 --steps 16

Run it on an otherwise idle machine: torch's threads wait for one another at every operation, so another busy
process on a 2-core CPU made the same steps several times slower in trials (and the engines' thread pools suffer
alike).

**Decode step.** The model is loaded in-process as a shard loads it (`bare.BareLoop`, one KV slot per row) and the
shard's `Engine` is driven directly, as the shard's service drives it (Prefill, Decode, FilterBatch) but with no
gRPC. Every row of the constrained batch follows the same nested JSON schema (`NESTED`) and is sampled at
temperature 1 with its own seed. The batch is kept full: every property is required, so the shortest valid text
is ~80 tokens on the demo-small tokenizer, longer than the warm-up plus the timed steps, and rows rarely finish
inside the measurement; when one does, a new request takes its slot at the next step, and that step (a prefill)
is left out, as are the warm-up steps. So every timed step is a pure decode step at the full batch size. A plain
batch of the same size (no constraint, EOS ignored so that no row ends) is stepped in turn with the constrained
one, so that whatever else the machine runs weighs on both alike. The table gives the median step (the shard's
`Timings.total_ns`), the median mask (`Timings.mask_ns`: filling the bitmask and masking the logits), the mask's
median share of the step, and the plain batch's median step; `step - plain` is the whole grammar overhead, the
matchers' advance included. After the timed steps the constrained rows run on, untimed, until they end (at most
--max-new-tokens), and their texts are checked to be JSON.

**Engines.** On the same tokenizer: the time to build each engine's view of the tokenizer, to compile the
nested schema and a large one (`large_schema`: 64 properties, each an object with a nested object, an enum and
an array), then a random walk of --walk-steps steps at each batch size: each step masks random logits [B, V]
in place and advances every row with the arg-max, i.e. a uniformly random allowed token (a row that finishes
starts again). The time is the mask (fill + apply) plus the advance, as each engine's own API does it: llguidance
through Conveyor's `GrammarCache` and `shard.masks.Masks` (its parallel batch fill); xgrammar's
`BatchGrammarMatcher` (batch fill and batch accept) and its CPU `apply_token_bitmask_inplace`; outlines-core has
no batch fill (one `Guide.write_mask_into` per row) and its apply kernel needs `torch.compile`, so its mask is
unpacked with Conveyor's `unpack` and applied with one in-place masked fill. Every engine gets the schema as
Conveyor compiles it (`grammar.closed`: no properties beyond the listed ones) and Conveyor's separators (", " and
": ") where it takes them (outlines-core allows an optional space instead). An engine that cannot be imported
is listed as skipped: xgrammar and outlines-core are no dependency of Conveyor's, not even of the `bench` extra
(xgrammar requires triton, a GPU compiler of no use beside the CPU torch); `pip install xgrammar outlines-core`
into the venv to compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from benchmarks.bare import BareLoop
from benchmarks.progress import note
from benchmarks.report import number
from conveyor.grammar import Constraint, GrammarCache, closed
from conveyor.v1 import shard_pb2 as pb

TARGET_SHARE = 10.0  # % of the decode step the mask may take at the largest batch (the target)
PROMPT = "The user record, as JSON:\n"
ENGINES = ("llguidance", "xgrammar", "outlines-core")

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 32},
                "city": {"type": "string", "maxLength": 20},
                "country": {"enum": ["FR", "DE", "US", "JP", "BR"]},
                "geo": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                        "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                },
            },
            "required": ["street", "city", "country", "geo"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 1,
            "maxItems": 5,
        },
        "manager": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "level": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["name", "level"],
        },
    },
    "required": ["id", "name", "role", "active", "address", "tags", "scores", "manager"],
}


def large_schema(properties: int) -> dict[str, Any]:
    """An object of `properties` objects, each with its own enum, a nested object and an array; half required."""

    def item(n: int) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "label": {"type": "string", "maxLength": 32},
                "kind": {"enum": [f"kind_{n}_{k}" for k in range(8)]},
                "meta": {
                    "type": "object",
                    "properties": {
                        "score": {"type": "number"},
                        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                    },
                    "required": ["score"],
                },
            },
            "required": ["id", "kind"],
        }

    names = [f"field_{n}" for n in range(properties)]
    return {"type": "object", "properties": {name: item(n) for n, name in enumerate(names)}, "required": names[::2]}


# --- the mask inside the decode step -----------------------------------------------------------------------------


@dataclass
class DecodeRun:
    """One batch size, constrained or not: its timed pure decode steps, and how its rows ended."""

    step_ns: list[int] = field(default_factory=list)
    mask_ns: list[int] = field(default_factory=list)
    admitted: int = 0  # requests, the first full batch included
    completed: list[str] = field(default_factory=list)  # texts of the rows that completed their grammar

    @property
    def step_ms(self) -> float:
        return statistics.median(self.step_ns) / 1e6

    @property
    def mask_ms(self) -> float:
        return statistics.median(self.mask_ns) / 1e6

    @property
    def mask_share(self) -> float:
        """The median over steps of mask / step, in %."""
        return statistics.median(m / s for m, s in zip(self.mask_ns, self.step_ns)) * 100.0

    @property
    def valid_json(self) -> int:
        return sum(_is_json(text) for text in self.completed)


@dataclass
class DecodeRow:
    batch: int
    constrained: DecodeRun
    plain: DecodeRun

    @property
    def overhead_ms(self) -> float:
        return self.constrained.step_ms - self.plain.step_ms


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class Lane:
    """One batch kept full through the Engine: its rows' KV slots, its running batch, what its steps measured."""

    grammar: str
    max_new_tokens: int
    free: list[int]  # KV slots without a row
    run: DecodeRun = field(default_factory=DecodeRun)
    running: Any = None  # the shard's `Batch`, None before the first step and once every row has ended
    slots: dict[int, int] = field(default_factory=dict)  # request id -> its KV slot
    decode_steps: int = 0  # pure decode steps at the full batch so far


class DecodeBench:
    """The shard's Engine in-process, one constrained and one plain batch of the same size stepped in turn, so
    that whatever else the machine runs weighs on both alike. A row that ends is replaced at the next step."""

    def __init__(self, loop: BareLoop, steps: int, warmup: int, drain_tokens: int) -> None:
        self.loop, self.engine, self.steps, self.warmup = loop, loop.engine, steps, warmup
        self.prompt = loop.tokenize(PROMPT)
        self.plain_tokens = warmup + steps + 2  # a plain row (EOS ignored) never ends inside the measurement
        self.drain_tokens = max(drain_tokens, self.plain_tokens)
        loop.allocate(len(self.prompt) + self.drain_tokens)
        self.engine.cache = loop.cache
        self._next_id = 0

    def run(self, batch_size: int, grammar: str) -> DecodeRow:
        """Both lanes until each has timed `steps` pure decode steps after `warmup`; then the constrained rows
        run to their end (untimed), so that every constrained text can be checked."""
        constrained = Lane(grammar, self.drain_tokens, list(range(batch_size)))
        plain = Lane("", self.plain_tokens, list(range(batch_size, 2 * batch_size)))
        while min(constrained.decode_steps, plain.decode_steps) < self.warmup + self.steps:
            for lane in (constrained, plain):
                if lane.decode_steps < self.warmup + self.steps:
                    self.step(lane, refill=True)
        while constrained.running is not None:
            self.step(constrained, refill=False)
        return DecodeRow(batch_size, constrained.run, plain.run)

    def step(self, lane: Lane, refill: bool) -> None:
        """One Prefill (rows joining the free slots, with the running ones) or Decode, then FilterBatch."""
        from conveyor.shard import offline

        new = self._admit(lane) if refill else []
        batch = lane.running
        if new:
            batch = offline.join(self.engine, batch, pb.Batch(id=new[0].id, requests=new, size=len(new)))
        generations, lane.running, timings = self.engine.step(batch)
        if not new and refill:
            lane.decode_steps += 1
            if lane.decode_steps > self.warmup:
                lane.run.step_ns.append(timings.total_ns)
                lane.run.mask_ns.append(timings.mask_ns)
        self._filter(lane, generations)

    def _admit(self, lane: Lane) -> list[pb.Request]:
        new = []
        while lane.free:
            slot = lane.free.pop()
            self._next_id += 1
            new.append(self.request(self._next_id, slot, lane))
            lane.slots[self._next_id] = slot
        lane.run.admitted += len(new)
        return new

    def request(self, request_id: int, slot: int, lane: Lane) -> pb.Request:
        return pb.Request(
            id=request_id,
            input_ids=self.prompt,
            parameters=pb.SamplingParameters(do_sample=True, temperature=1.0, seed=request_id),
            stopping_parameters=pb.StoppingParameters(
                max_new_tokens=lane.max_new_tokens, ignore_eos_token=not lane.grammar
            ),
            blocks=self.loop.table(slot),
            grammar=lane.grammar,
        )

    @staticmethod
    def _filter(lane: Lane, generations: list[pb.Generation]) -> None:
        """Drops the rows that ended (FilterBatch), freeing their slots; keeps the texts that completed."""
        done = [g for g in generations if g.HasField("finished")]
        for g in done:
            lane.free.append(lane.slots.pop(g.request_id))
            if g.finished.finish_reason == pb.FINISH_REASON_EOS_TOKEN:
                lane.run.completed.append(g.finished.text)
        if lane.running is not None and done:
            ended = {g.request_id for g in done}
            kept = [r.id for r in lane.running.requests if r.id not in ended]
            lane.running = lane.running.filter(kept) if kept else None


def measure_decode(
    model_dir: Path, batch_sizes: list[int], steps: int, warmup: int, drain_tokens: int
) -> list[DecodeRow]:
    note(f"decode step: loading {model_dir} in-process")
    bench = DecodeBench(BareLoop(model_dir, 2 * max(batch_sizes)), steps, warmup, drain_tokens)
    grammar = Constraint.json_schema(NESTED).grammar
    rows = []
    for size in batch_sizes:
        note(f"decode step: batch {size}, {steps} steps constrained and plain in turn, then the rows to their end...")
        rows.append(bench.run(size, grammar))
    return rows


def print_decode(rows: list[DecodeRow], steps: int) -> None:
    print(f"mask inside the decode step (nested JSON schema on every row, temperature 1, median of {steps} steps)")
    heads = ("batch", "step ms", "mask ms", "mask %", "plain step ms", "step - plain ms", "readmitted", "valid JSON")
    print("  ".join(f"{h:>{max(len(h), 6)}}" for h in heads))
    for row in rows:
        c = row.constrained
        cells = (
            str(row.batch),
            number(c.step_ms, 2),
            number(c.mask_ms, 2),
            number(c.mask_share, 1),
            number(row.plain.step_ms, 2),
            number(row.overhead_ms, 2),
            str(c.admitted - row.batch),
            f"{c.valid_json}/{c.admitted}",
        )
        print("  ".join(f"{cell:>{max(len(h), 6)}}" for cell, h in zip(cells, heads)))
    largest = max(rows, key=lambda row: row.batch)
    share = largest.constrained.mask_share
    verdict = "met" if share <= TARGET_SHARE else "NOT met"
    print(
        f"target: mask <= {TARGET_SHARE:g}% of the step at batch {largest.batch}: {share:.1f}% -> {verdict}\n",
        flush=True,
    )


# --- the engines side by side ------------------------------------------------------------------------------------


class GrammarEngine(Protocol):
    """What the random walk needs of an engine; `setup` builds its tokenizer view, `compile` returns a grammar."""

    def setup(self) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def mask(self, matchers: list[Any], logits: torch.Tensor) -> None: ...
    def advance(self, matchers: list[Any], tokens: list[int]) -> None: ...
    def done(self, matcher: Any) -> bool: ...


@dataclass
class Vocab:
    tokenizer: Any
    size: int  # the logits' width
    eos: frozenset[int]


class Llguidance:
    """Conveyor's own path: `Constraint` to grammar text, `GrammarCache`, `Masks.apply`, `consume_token`."""

    def __init__(self, vocab: Vocab) -> None:
        from conveyor.shard.offline import Masks

        self.cache, self.masks = GrammarCache(vocab.tokenizer, vocab.size, vocab.eos), Masks(vocab.eos)

    def setup(self) -> None:
        self.cache.compile(Constraint("json_object").grammar)  # the tokenizer view is built at the first compile

    def compile(self, schema: dict[str, Any]) -> str:
        grammar = Constraint.json_schema(schema).grammar
        self.cache.compile(grammar)
        return grammar

    def matcher(self, compiled: str) -> Any:
        return self.cache.matcher(compiled)

    def mask(self, matchers: list[Any], logits: torch.Tensor) -> None:
        self.masks.apply(logits, matchers)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        for m, token in zip(matchers, tokens):
            if not m.consume_token(token):
                raise RuntimeError(f"llguidance refused an allowed token: {m.get_error()}")

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


class Xgrammar:
    def __init__(self, vocab: Vocab) -> None:
        import xgrammar

        self.xg, self.vocab = xgrammar, vocab
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def setup(self) -> None:
        v = self.vocab
        info = self.xg.TokenizerInfo.from_huggingface(v.tokenizer, vocab_size=v.size, stop_token_ids=sorted(v.eos))
        self.compiler = self.xg.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            json.dumps(closed(schema)), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def mask(self, matchers: list[Any], logits: torch.Tensor) -> None:
        bitmask = self.xg.allocate_token_bitmask(len(matchers), self.vocab.size)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        self.xg.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        if not all(self.batch.batch_accept_token(matchers, tokens)):
            raise RuntimeError("xgrammar refused an allowed token")

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


class OutlinesCore:
    def __init__(self, vocab: Vocab) -> None:
        import outlines_core

        self.oc, self.vocab = outlines_core, vocab

    def setup(self) -> None:
        """Its vocabulary wants each token's bytes: the byte-level BPE alphabet mapped back to bytes."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
        eos = min(self.vocab.eos)
        tokens: dict[bytes, list[int]] = {}
        for text, token in self.vocab.tokenizer.get_vocab().items():
            if token != eos and token < self.vocab.size and all(c in to_byte for c in text):
                tokens.setdefault(bytes(to_byte[c] for c in text), []).append(token)
        self.vocabulary = self.oc.Vocabulary(eos, tokens)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(closed(schema)))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def mask(self, matchers: list[Any], logits: torch.Tensor) -> None:
        from conveyor.shard.offline import unpack

        bitmask = torch.zeros(len(matchers), (self.vocab.size + 31) // 32, dtype=torch.int32)
        for guide, row in zip(matchers, bitmask):
            guide.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        logits.masked_fill_(~unpack(bitmask, self.vocab.size), float("-inf"))

    def advance(self, matchers: list[Any], tokens: list[int]) -> None:
        for guide, token in zip(matchers, tokens):
            guide.advance(token, return_tokens=False)

    def done(self, matcher: Any) -> bool:
        return matcher.is_finished()


FACTORIES: dict[str, Callable[[Vocab], GrammarEngine]] = {
    "llguidance": Llguidance,
    "xgrammar": Xgrammar,
    "outlines-core": OutlinesCore,
}


@dataclass
class EngineRow:
    name: str
    setup_ms: float | None = None
    nested_ms: float | None = None
    large_ms: float | None = None
    step_ms: dict[int, float] = field(default_factory=dict)
    skipped: str | None = None  # why there are no figures


def _timed(action: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = action()
    return result, (time.perf_counter() - start) * 1000.0


def random_walk(engine: GrammarEngine, compiled: Any, batch: int, steps: int, vocab: int, warmup: int = 2) -> float:
    """Median ms of mask + advance over `steps` steps (after `warmup`), each row taking a random allowed token."""
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    generator = torch.Generator().manual_seed(batch)
    times = []
    for _ in range(warmup + steps):
        logits = torch.rand(batch, vocab, generator=generator)
        start = time.perf_counter()
        engine.mask(matchers, logits)
        tokens = logits.argmax(dim=-1).tolist()
        middle = time.perf_counter()
        engine.advance(matchers, tokens)
        times.append((time.perf_counter() - middle) + (middle - start))
        matchers = [engine.matcher(compiled) if engine.done(m) else m for m in matchers]
    return statistics.median(times[warmup:]) * 1000.0


def measure_engine(name: str, vocab: Vocab, large: dict[str, Any], batches: list[int], steps: int) -> EngineRow:
    try:
        engine = FACTORIES[name](vocab)
    except ImportError as exc:
        return EngineRow(name, skipped=f"skipped: not importable ({exc.name or exc})")
    note(f"engines: {name}: tokenizer view and compiles...")
    row = EngineRow(name)
    _, row.setup_ms = _timed(engine.setup)
    compiled, row.nested_ms = _timed(lambda: engine.compile(NESTED))
    _, row.large_ms = _timed(lambda: engine.compile(large))
    for batch in batches:
        note(f"engines: {name}: random walk at batch {batch}...")
        row.step_ms[batch] = random_walk(engine, compiled, batch, steps, vocab.size)
    return row


def measure_engines(
    model_dir: Path, names: list[str], batches: list[int], steps: int, properties: int
) -> list[EngineRow]:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = Vocab(tokenizer, AutoConfig.from_pretrained(model_dir).vocab_size, frozenset([tokenizer.eos_token_id]))
    large = large_schema(properties)
    return [measure_engine(name, vocab, large, batches, steps) for name in names]


def print_engines(rows: list[EngineRow], batches: list[int], steps: int, properties: int) -> None:
    print(
        f"grammar engines (compile in ms; mask + advance per step in ms, median of a {steps}-step random walk; "
        f"large = {properties} properties)"
    )
    heads = ["engine", "tokenizer", "nested", "large"] + [f"step b{b}" for b in batches]
    widths = [14] + [max(len(h), 9) for h in heads[1:]]
    print("  ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w) in enumerate(zip(heads, widths))))
    for row in rows:
        if row.skipped:
            print(f"{row.name:<{widths[0]}}  {row.skipped}")
            continue
        cells = [number(row.setup_ms, 0), number(row.nested_ms, 1), number(row.large_ms, 1)]
        cells += [number(row.step_ms[b], 2) for b in batches]
        print(f"{row.name:<{widths[0]}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths[1:])), flush=True)


# --- the command ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-id", default="demo", help="a model directory, or 'demo' (built by the launcher)")
    p.add_argument("--demo-size", default="small", help="the demo model's size, with --model-id demo")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated; the target is checked at the largest")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    p.add_argument("--warmup", type=int, default=4, help="decode steps run before the timed ones")
    p.add_argument("--max-new-tokens", type=int, default=256, help="of a constrained row (it then ends unfinished)")
    p.add_argument("--walk-steps", type=int, default=48, help="timed steps of each engine's random walk")
    p.add_argument("--large-properties", type=int, default=64, help="properties of the large schema")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    p.add_argument("--skip-decode", action="store_true", help="only the engines table")
    p.add_argument("--skip-engines", action="store_true", help="only the decode-step table")
    args = p.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    from conveyor.model_source import resolve_model

    args = parse_args(argv)
    model_dir = resolve_model(args.model_id, args.demo_size)
    if not args.skip_decode:
        rows = measure_decode(model_dir, args.batch_sizes, args.steps, args.warmup, args.max_new_tokens)
        print_decode(rows, args.steps)
    if not args.skip_engines:
        rows = measure_engines(model_dir, args.engines, args.batch_sizes, args.walk_steps, args.large_properties)
        print_engines(rows, args.batch_sizes, args.walk_steps, args.large_properties)


if __name__ == "__main__":
    main()
