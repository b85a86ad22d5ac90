"""`python -m benchmarks.serve`: a serving load generator for any OpenAI-compatible or TGI-style endpoint.

    python -m benchmarks.serve --base-url http://127.0.0.1:3000 --num-prompts 64 --input-len-range 32,256 \\
        --output-len 64 --ignore-eos --request-rate 1,2,inf --max-concurrency 32 --json out.json --plot out.png
    python -m benchmarks.serve plot a.json b.json --out both.png      # one line per system

A seeded synthetic prompt set (token-exact with --tokenizer, words otherwise) is sent once per request rate,
the same prompts every time, with Poisson (--burstiness 1) or gamma arrivals or all at once (rate inf), under an
optional concurrency cap. Every request streams; its output length is set by max_tokens, with EOS ignored where
the server allows (--ignore-eos; --no-extra-fields keeps to the OpenAI schema for servers that reject other
fields, such as `transformers serve`). Metrics use vLLM's definitions: request, output and total token
throughput, TTFT, TPOT, ITL and E2EL (mean, median, p99), and goodput for --goodput SLOs. Progress goes to
stderr, the table to stdout. Library use: `await run(BenchmarkConfig(...))` returns a `BenchmarkResult`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.backends import BACKENDS, Backend, RequestOptions, backend
from benchmarks.client import RequestRecord, send
from benchmarks.metrics import SLO_METRICS, BenchmarkResult, RateResult, load_results, summarize
from benchmarks.plot import plot_results
from benchmarks.progress import Progress, note
from benchmarks.report import format_result
from benchmarks.workload import KINDS, LengthSpec, Prompt, arrival_offsets, build_prompts

WARMUP_TOKENS = 8  # warm-up requests only need to touch every code path once
DEFAULT_MODEL = "default"


@dataclass
class BenchmarkConfig:
    base_url: str
    backend: str = "openai-completions"
    model: str | None = None  # None: the first id of GET /v1/models
    label: str | None = None  # the system's name in tables, JSON and plots
    num_prompts: int = 100
    input_len: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 128))
    output_len: LengthSpec = field(default_factory=lambda: LengthSpec("fixed", 64))
    seed: int = 0
    request_rates: list[float] = field(default_factory=lambda: [math.inf])
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    extra_fields: bool = True
    speculate: int | None = None  # Conveyor's draft tokens per step for every request (None: the server's)
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    tokenizer: str | None = None  # a model directory: token-exact prompts, and output counts without usage
    num_warmups: int = 0
    request_timeout: float = 3600.0
    show_progress: bool = True


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def default_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists; "default" when it lists none or cannot (transformers serve answers 500
    without a hub cache folder)."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            if response.status == 200:
                data = (await response.json()).get("data") or []
                if data and data[0].get("id"):
                    return str(data[0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        pass
    return DEFAULT_MODEL


def length_stats(values: list[int]) -> str:
    return f"{min(values)}-{max(values)}, mean {sum(values) / len(values):.1f}" if values else "none"


def workload_dict(config: BenchmarkConfig, prompts: list[Prompt], built_here: bool) -> dict[str, Any]:
    """What was sent, as measured from the prompts themselves, plus the specs they were drawn from."""
    unit = "" if all(p.exact for p in prompts) else " (words)"
    return {
        "num_prompts": len(prompts),
        "input_len": length_stats([p.prompt_len for p in prompts]) + unit,
        "output_len": length_stats([p.output_len for p in prompts]),
        "input_spec": config.input_len.to_dict() if built_here else "custom",
        "output_spec": config.output_len.to_dict() if built_here else "custom",
        "seed": config.seed,
        "tokenizer": config.tokenizer,
        "request_rates": ["inf" if math.isinf(r) else r for r in config.request_rates],
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "extra_fields": config.extra_fields,
        "speculate": config.speculate,
        "goodput_slos_ms": config.goodput_slos_ms,
    }


@dataclass
class _Target:
    """What every request of a run shares."""

    session: aiohttp.ClientSession
    url: str
    backend: Backend
    options: RequestOptions
    tokenizer: Any
    limit: asyncio.Semaphore | None


async def _send_bounded(target: _Target, prompt: Prompt, run_start: float) -> RequestRecord:
    """The concurrency cap is taken before the clock starts, as vLLM does: waiting for a slot is not latency."""
    async with target.limit or contextlib.nullcontext():
        return await send(
            target.session, target.url, target.backend, prompt, target.options, target.tokenizer, run_start
        )


async def warm_up(target: _Target, prompts: list[Prompt], count: int) -> None:
    """A few short requests first, unmeasured: first requests pay one-off costs (allocations, lazy imports)."""
    if count <= 0 or not prompts:
        return
    picked = [
        Prompt(p.index, p.text, p.prompt_len, min(p.output_len, WARMUP_TOKENS), p.exact)
        for p in (prompts * count)[:count]
    ]
    records = await asyncio.gather(*(_send_bounded(target, p, 0.0) for p in picked))
    failed = [r for r in records if not r.success]
    if failed:
        note(f"  warning: {len(failed)} of {count} warm-up requests failed: {failed[0].error}")


async def run_rate(
    target: _Target, config: BenchmarkConfig, prompts: list[Prompt], rate: float, label: str
) -> RateResult:
    """Every prompt once, each sent at its scheduled offset; the duration runs from the start to the last answer."""
    offsets = arrival_offsets(len(prompts), rate, config.burstiness, config.seed)
    progress = Progress(
        f"{label} at rate {'inf' if math.isinf(rate) else f'{rate:g}'}", len(prompts), config.show_progress
    )
    start = time.perf_counter()

    async def one(prompt: Prompt, offset: float) -> RequestRecord:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await _send_bounded(target, prompt, start)
        progress.advance(record.success)
        return record

    records = await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets)))
    duration = time.perf_counter() - start
    progress.close()
    return summarize(list(records), duration, rate, config.burstiness, config.max_concurrency, config.goodput_slos_ms)


async def run(config: BenchmarkConfig, prompts: list[Prompt] | None = None) -> BenchmarkResult:
    """Runs the workload once per request rate against one system; `prompts` replaces the built workload."""
    tokenizer = load_tokenizer(config.tokenizer)
    built_here = prompts is None
    if prompts is None:
        prompts = build_prompts(config.num_prompts, config.input_len, config.output_len, config.seed, tokenizer)
    if config.ignore_eos and not config.extra_fields:
        note("  note: --no-extra-fields: ignore_eos is not sent, so outputs may end early at EOS")
    base_url = config.base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=config.request_timeout)
    # A connection per request: a server may close a kept-alive connection between two requests (llama.cpp's
    # HTTP server does after a few), and the pooled connection's next request then fails before it is sent.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = config.model or await default_model(session, base_url)
        label = config.label or model
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        target = _Target(
            session,
            base_url,
            backend(config.backend),
            RequestOptions(model, config.ignore_eos, config.extra_fields, config.speculate),
            tokenizer,
            limit,
        )
        await warm_up(target, prompts, config.num_warmups)
        runs = [await run_rate(target, config, prompts, rate, label) for rate in config.request_rates]
    return BenchmarkResult(label, config.backend, base_url, model, workload_dict(config, prompts, built_here), runs)


# --- command line ---------------------------------------------------------------------------------------------


def rate_list(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("request rates must be positive numbers or inf")
    return rates


def length_range(text: str) -> tuple[int, int]:
    """LOW,HIGH (or LOW-HIGH); a single number is a range of one."""
    low, _, high = text.replace("-", ",").partition(",")
    return int(low), int(high or low)


def slo(text: str) -> tuple[str, float]:
    name, _, value = text.partition(":")
    if name not in SLO_METRICS or not value:
        raise argparse.ArgumentTypeError(f"an SLO is NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
    return name, float(value)


def add_length_options(p: argparse.ArgumentParser, kind: str, default: int) -> None:
    p.add_argument(
        f"--{kind}-len",
        type=int,
        default=default,
        help=f"{kind} tokens (the mean for normal and exponential, clipped to a range if given)",
    )
    p.add_argument(
        f"--{kind}-len-range",
        type=length_range,
        default=None,
        metavar="LOW,HIGH",
        help="uniform over this range (inclusive)",
    )
    p.add_argument(
        f"--{kind}-len-dist", choices=KINDS, default=None, help="default: uniform with a range, fixed otherwise"
    )
    p.add_argument(f"--{kind}-len-std", type=float, default=0.0, help="the standard deviation for normal")


def length_spec(args: argparse.Namespace, kind: str) -> LengthSpec:
    span = getattr(args, f"{kind}_len_range")
    dist = getattr(args, f"{kind}_len_dist") or ("uniform" if span else "fixed")
    if dist == "uniform" and span is None:
        raise ValueError(f"--{kind}-len-dist uniform needs --{kind}-len-range LOW,HIGH")
    low, high = span or (0, 0)
    return LengthSpec(dist, getattr(args, f"{kind}_len"), getattr(args, f"{kind}_len_std"), low, high)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:3000")
    p.add_argument("--backend", choices=BACKENDS, default="openai-completions")
    p.add_argument("--model", default=None, help='sent as "model"; default: the first id of GET /v1/models')
    p.add_argument("--label", default=None, help="the system's name in the table, JSON and plot")
    p.add_argument("--num-prompts", type=int, default=100)
    add_length_options(p, "input", 128)
    add_length_options(p, "output", 64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="for token-exact prompts and output counts")
    p.add_argument(
        "--request-rate",
        type=rate_list,
        default=[math.inf],
        metavar="R[,R...]",
        help="requests per second, one run per rate on the same prompts; inf sends all at once",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps: 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: outputs run to max_tokens")
    p.add_argument(
        "--no-extra-fields",
        dest="extra_fields",
        action="store_false",
        help="send only OpenAI-schema fields (no ignore_eos): for servers that reject others",
    )
    p.add_argument(
        "--goodput",
        type=slo,
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs (ttft, tpot, e2el in ms) a request must all meet to count as goodput",
    )
    p.add_argument("--num-warmups", type=int, default=0, help="unmeasured short requests sent first")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--detailed", action="store_true", help="include every request's timings in the JSON")
    p.add_argument("--plot", type=Path, default=None, help="draw throughput and latency against rate here (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    try:
        args.input_spec, args.output_spec = length_spec(args, "input"), length_spec(args, "output")
    except ValueError as exc:
        p.error(str(exc))
    if args.num_prompts < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-prompts and --max-concurrency must be at least 1")
    return args


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    return BenchmarkConfig(
        base_url=args.base_url,
        backend=args.backend,
        model=args.model,
        label=args.label,
        num_prompts=args.num_prompts,
        input_len=args.input_spec,
        output_len=args.output_spec,
        seed=args.seed,
        request_rates=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        extra_fields=args.extra_fields,
        goodput_slos_ms=dict(args.goodput),
        tokenizer=args.tokenizer,
        num_warmups=args.num_warmups,
        request_timeout=args.request_timeout,
        show_progress=not args.quiet,
    )


def plot_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve plot", description="Draws result JSON files into one PNG, one line per system."
    )
    p.add_argument("results", type=Path, nargs="+", help="files written by --json")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    print(plot_results(load_results(args.results), args.out, args.title))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    args = parse_args(argv)
    result = asyncio.run(run(config_from_args(args)))
    print(format_result(result))
    if args.json:
        result.write(args.json, args.detailed)
        note(f"wrote {args.json}")
    if args.plot:
        note(f"wrote {plot_results([result.to_dict()], args.plot)}")
    if any(r.completed == 0 for r in result.runs):
        sys.exit(1)  # a rate at which nothing completed measured nothing: say so in the exit status


if __name__ == "__main__":
    main()
