"""Conveyor's scheduling modes, vLLM's CPU build, llama.cpp's server, `transformers serve` and the bare forward, on
the same models and the same workloads, in one run.

    make bench                                                   # the real model, then the demo `small` model
    .venv/bin/python -m benchmarks.compare --quick --model-id real --skip-transformers   # a smoke run

Each model is compared in turn (--model-id, default `real,demo`): `real` is SmolLM2-135M-Instruct as
benchmarks/real_model.py prepares it (a float32 directory: real text, activations, tokenizer and chat template,
which random weights lack), `demo` the launcher's random-weight demo model (--demo-size), anything else a model
directory or Hub id. Every system serves the same directory (llama.cpp after its own converter turned it into
GGUF). Before anything of the real model is timed, Conveyor serves it and must answer real_model.CHECK_QUESTION
(greedy, through the chat route) with real_model.CHECK_ANSWER in the answer, or the run stops: a preparation that
broke the weights or the tokenizer would otherwise be measured as if it were the model. Each model's results go
to a folder of its own under --out, named as its directory, and its report starts with that name.

Every system is started here (Conveyor through its launcher with --scheduling continuous|static|sequential;
vLLM's CPU build from its own venv, `.venv-vllm`, with the model's threads bound to every core and again with
its default binding; llama.cpp's `llama-server` from `.venv-llamacpp` on the model converted to GGUF by llama.cpp's
own converter, --parallel at the concurrency cap, a thread per core; `transformers serve DIR
--continuous-batching --device cpu`), warmed up, sent the same
seeded workloads over
its OpenAI completions route (greedy, output length fixed by max_tokens, EOS ignored where the server allows;
`transformers serve` gets only OpenAI-schema fields), then stopped:

  throughput  all prompts at once under a concurrency cap (output lengths vary, so a static batch waits on its
              longest member as it would in real traffic), on every system;
  single      one request at a time (batch 1): the inter-token latency one person chatting alone feels, on
              Conveyor continuous, vLLM and llama.cpp; Conveyor runs it again with drafts off (each request asks
              for `speculate: 0`), whose time per token the bare forward's decode step at batch 1 is set against;
  sweep       Poisson arrivals at a few rates, for the latency-against-load plot;
  long        ~2k-token prompts arriving among short streams (Conveyor continuous): how much a long prefill
              stalls the short streams' inter-token latency.

The bare-forward ceiling runs the throughput workload through the same model in-process, at the concurrency cap
as batch size (and the single workload at batch 1 right after Conveyor served it, in the same weights), with the
linear layers on oneDNN (what the shard runs) and again on torch's F.linear (MKL), which shows what the
packed-weight GEMM wins. With bfloat16 among --dtypes (the default only where oneDNN has bf16
kernels for the CPU; CONVEYOR_CPU_BF16=0 leaves it out anywhere), Conveyor continuous, vLLM (all cores),
transformers serve and the bare forward run again in it. The report prints each system's metrics, then the
ratios against the targets. JSON for every run, a summary and the sweep plot go to the model's folder under
--out. A system that cannot run (no --scheduling in the launcher, no `transformers serve` installed) is reported
as skipped and the rest still runs; a failed one makes the exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from benchmarks import bare, deploy, real_model, roofline
from benchmarks.compare_report import (
    BARE,
    BARE_ONE,
    BARE_TORCH_GEMM,
    BF16,
    CONTINUOUS,
    LLAMACPP,
    NO_DRAFTS,
    QUANTIZED,
    TRANSFORMERS,
    VLLM,
    Outcome,
    one_stream_bandwidth,
    print_report,
    summary_dict,
)
from benchmarks.docs_tables import write_sitting
from benchmarks.metrics import BenchmarkResult
from benchmarks.plot import plot_results
from benchmarks.progress import note
from benchmarks.serve import BenchmarkConfig, length_range, load_tokenizer, run
from benchmarks.workload import LengthSpec, Prompt, Workload, build_prompts
from conveyor import cpu

MODES = ("continuous", "static", "sequential")
DTYPE_SUFFIX = {"float32": "", "bfloat16": BF16}
RESULTS = Path(__file__).resolve().parent / "results"
REAL = "real"  # --model-id: SmolLM2-135M-Instruct, prepared by benchmarks/real_model.py
MODELS = [REAL, "demo"]  # the default: the real model first (what users see), then the demo model
CHECK_TOKENS = 30  # enough for a sentence naming the answer


def spec(span: tuple[int, int]) -> LengthSpec:
    low, high = span
    return LengthSpec("fixed", low) if low == high else LengthSpec("uniform", low=low, high=high)


def long_mix(args: argparse.Namespace, tokenizer: Any) -> Workload:
    """Short streams with the long prompts spread evenly among them (never first: they arrive mid-stream)."""
    seed = args.seed + 2
    short = build_prompts(
        args.short_prompts, spec(args.short_input_len), spec((args.short_output_len,) * 2), seed, tokenizer
    )
    long = build_prompts(
        args.long_prompts,
        spec((args.long_len,) * 2),
        spec((args.long_output_len,) * 2),
        seed + 100,
        tokenizer,
        first_index=len(short),
    )
    order: list[Prompt] = list(short)
    every = max(1, len(short) // (len(long) + 1))
    for n, prompt in enumerate(long, start=1):
        order.insert(min(len(order), n * every + n - 1), prompt)
    return Workload("long", order, [args.long_rate], None, seed, {p.index for p in short})


def build_workloads(args: argparse.Namespace, tokenizer: Any) -> dict[str, Workload]:
    inputs, outputs = spec(args.input_len), spec(args.output_len)
    if args.output_mean:
        low, high = args.output_len
        outputs = LengthSpec("exponential", args.output_mean, low=low, high=high)
    workloads = {
        "throughput": Workload(
            "throughput",
            build_prompts(args.num_prompts, inputs, outputs, args.seed, tokenizer),
            [float("inf")],
            args.max_concurrency,
            args.seed,
        ),
        "sweep": Workload(
            "sweep",
            build_prompts(args.sweep_prompts, inputs, outputs, args.seed + 1, tokenizer),
            args.sweep_rates,
            args.max_concurrency,
            args.seed + 1,
        ),
        "long": long_mix(args, tokenizer),
    }
    single = build_prompts(args.single_prompts, inputs, spec((args.single_output_len,) * 2), args.seed + 3, tokenizer)
    workloads["single"] = Workload("single", single, [float("inf")], 1, args.seed + 3)
    workloads[NO_DRAFTS] = Workload(NO_DRAFTS, single, [float("inf")], 1, args.seed + 3, speculate=0)
    return workloads


def plan(args: argparse.Namespace, system: str) -> list[str]:
    """Which workloads a system runs: throughput always; single, sweep and long where the options name it."""
    short = system.removeprefix("conveyor-").removesuffix(BF16)
    for suffix in QUANTIZED.values():
        short = short.removesuffix(suffix)
    chosen = (("single", args.single_systems), ("sweep", args.sweep_systems), ("long", args.long_systems))
    planned = ["throughput"] + [name for name, systems in chosen if short in systems]
    if "single" in planned and system.startswith("conveyor-"):
        planned.insert(planned.index("single") + 1, NO_DRAFTS)  # the same stream with drafts off, against the bare
    return planned


def measure(
    args: argparse.Namespace,
    system: str,
    url: str,
    workloads: dict[str, Workload],
    model: str | None,
    extra_fields: bool,
) -> dict[str, BenchmarkResult]:
    """Runs the system's planned workloads against `url`; only the first gets the warm-up requests."""
    results = {}
    warmups = args.num_warmups
    for name in plan(args, system):
        w = workloads[name]
        note(f"  {system}: {name} workload, {len(w.prompts)} prompts")
        config = BenchmarkConfig(
            base_url=url,
            model=model,
            label=system,
            seed=w.seed,
            request_rates=w.rates,
            max_concurrency=w.max_concurrency,
            ignore_eos=True,
            extra_fields=extra_fields,
            speculate=w.speculate,
            tokenizer=str(args.model_dir),
            num_warmups=warmups,
            request_timeout=args.request_timeout,
        )
        results[name] = asyncio.run(run(config, w.prompts))
        warmups = 0
    return results


def conveyor_flags(args: argparse.Namespace, mode: str, known: set[str]) -> list[str] | None:
    """Launcher flags for one scheduling mode; None when this launcher cannot run that mode."""
    if "--scheduling" in known:
        flags = ["--scheduling", mode]
    elif mode == "continuous":
        flags = []  # an older launcher: continuous batching is what it does anyway
    else:
        return None
    if mode == "static":
        flags += ["--max-batch-size", str(args.max_concurrency), "--static-batch-timeout", str(args.static_timeout)]
    if not args.prefix_caching and "--no-prefix-caching" in known:
        flags.append("--no-prefix-caching")
    return flags + list(args.launcher_arg)


def failed(system: str, exc: Exception) -> Outcome:
    """A deployment failure carries the server's log tail already; anything else says where the log was kept."""
    message = str(exc) if isinstance(exc, deploy.DeploymentFailed) else f"{type(exc).__name__}: {exc} (server log kept)"
    note(f"FAILED: {system}: {message}")
    return Outcome(system, "failed", message)


def run_conveyor(
    args: argparse.Namespace,
    mode: str,
    workloads: dict[str, Workload],
    known: set[str],
    dtype: str = "float32",
    quantize: str | None = None,
) -> Outcome:
    system = f"conveyor-{mode}{DTYPE_SUFFIX[dtype]}" + (QUANTIZED[quantize] if quantize else "")
    flags = conveyor_flags(args, mode, known)
    if flags is None:
        return Outcome(system, "skipped", "this launcher has no --scheduling flag, so it cannot run this mode")
    flags = ["--dtype", dtype, *(["--quantize", quantize] if quantize else []), *flags]
    try:
        with deploy.conveyor(deploy.ConveyorSpec(system, args.model_dir, flags), args.startup_timeout) as url:
            return Outcome(system, "ok", None, measure(args, system, url, workloads, None, True))
    except Exception as exc:  # noqa: BLE001 - one system's failure is reported; the others still run
        return failed(system, exc)


def transformers_kv(args: argparse.Namespace, workloads: dict[str, Workload]) -> tuple[int, int]:
    """KV blocks for the cap's worth of its longest sequences, twice over, so the cache never binds."""
    planned = [workloads[n] for n in plan(args, TRANSFORMERS)]
    longest = max(p.prompt_len + p.output_len for w in planned for p in w.prompts)
    per_seq = -(-longest // args.tserve_block_size)
    return 2 * per_seq * args.max_concurrency + 8, args.tserve_block_size


def run_peer(
    args: argparse.Namespace,
    workloads: dict[str, Workload],
    system: str,
    skipped: str | None,
    problem: Callable[[], str | None],
    serve: Callable[[], AbstractContextManager[str]],
    extra_fields: bool = True,
) -> Outcome:
    """A peer: skipped with the reason (`skipped`, the flag that said so, or what `problem` finds missing), or
    started by `serve`, measured and stopped. Each serves the model under its directory's path."""
    if skipped:
        return Outcome(system, "skipped", skipped)
    if (missing := problem()) is not None:
        return Outcome(system, "skipped", f"{system} cannot run here: {missing}")
    try:
        with serve() as url:
            return Outcome(system, "ok", None, measure(args, system, url, workloads, str(args.model_dir), extra_fields))
    except Exception as exc:  # noqa: BLE001 - as for Conveyor's modes
        return failed(system, exc)


def run_transformers(args: argparse.Namespace, workloads: dict[str, Workload], dtype: str = "float32") -> Outcome:
    def serve() -> AbstractContextManager[str]:
        blocks, block_size = transformers_kv(args, workloads)
        batch_tokens, timeout = args.tserve_max_batch_tokens, args.startup_timeout
        return deploy.transformers_serve(args.model_dir, blocks, block_size, batch_tokens, timeout, dtype)

    skipped = "--skip-transformers" if args.skip_transformers else None
    system = TRANSFORMERS + DTYPE_SUFFIX[dtype]
    problem = deploy.transformers_serve_problem
    # It serves only the pinned model, under the name it was given; it answers 422 to ignore_eos.
    return run_peer(args, workloads, system, skipped, problem, serve, extra_fields=False)


def vllm_name(binding: str, dtype: str) -> str:
    return VLLM + ("" if binding == "all" else f"-{binding}") + DTYPE_SUFFIX[dtype]


def run_vllm(args: argparse.Namespace, workloads: dict[str, Workload], binding: str, dtype: str = "float32") -> Outcome:
    return run_peer(
        args,
        workloads,
        vllm_name(binding, dtype),
        "--skip-vllm" if args.skip_vllm else None,
        deploy.vllm_problem,
        lambda: deploy.vllm_serve(args.model_dir, dtype, binding, args.startup_timeout),
    )


def run_llamacpp(args: argparse.Namespace, workloads: dict[str, Workload], dtype: str = "float32") -> Outcome:
    """llama.cpp with a slot per concurrent request, each slot as long as the longest request it will serve.
    `dtype` int8 (int4): its q8_0 (q4_0) weights."""
    system = LLAMACPP + {**DTYPE_SUFFIX, **QUANTIZED}[dtype]

    def serve() -> AbstractContextManager[str]:
        longest = max(p.prompt_len + p.output_len for name in plan(args, system) for p in workloads[name].prompts)
        slots, timeout = args.max_concurrency, args.startup_timeout
        return deploy.llamacpp_serve(args.model_dir, dtype, slots, longest + 64, timeout)

    return run_peer(
        args, workloads, system, "--skip-llamacpp" if args.skip_llamacpp else None, deploy.llamacpp_problem, serve
    )


def run_bare(
    args: argparse.Namespace,
    workload: Workload,
    dtype: str = "float32",
    gemm: str = "auto",
    quantize: str | None = None,
) -> bare.BareResult | str:
    """The ceiling at the workload's concurrency cap, or why there is none."""
    if args.skip_bare:
        return "skipped (--skip-bare)"
    try:
        return bare.measure(
            args.model_dir,
            [p.text for p in workload.prompts],
            [p.output_len for p in workload.prompts],
            workload.max_concurrency or args.max_concurrency,
            dtype=dtype,
            gemm=gemm,
            quantize=quantize,
        )
    except Exception as exc:  # noqa: BLE001 - reported in the table; the rest of the comparison stands
        note(f"FAILED: bare forward: {type(exc).__name__}: {exc}")
        return f"failed: {type(exc).__name__}: {exc}"


def run_ceilings(args: argparse.Namespace, workload: Workload) -> dict[str, bare.BareResult | str]:
    """The bare forward as the shard runs it, on F.linear (the GEMM baseline), and in each further dtype."""
    ceilings = {BARE: run_bare(args, workload)}
    if args.gemm_baseline:
        ceilings[BARE_TORCH_GEMM] = run_bare(args, workload, gemm="torch")
    for dtype in args.dtypes[1:]:
        ceilings[BARE + DTYPE_SUFFIX[dtype]] = run_bare(args, workload, dtype)
    return ceilings


def run_continuous(
    args: argparse.Namespace,
    workloads: dict[str, Workload],
    known: set[str],
    ceilings: dict[str, bare.BareResult | str],
    dtype: str = "float32",
    quantize: str | None = None,
) -> Outcome:
    """Conveyor continuous; then, where it served the single workload with drafts off, the bare forward at batch 1
    on that workload in the same weights (into `ceilings`), right after it: the VM's speed drifts over a sitting,
    and the two are set against each other."""
    outcome = run_conveyor(args, "continuous", workloads, known, dtype, quantize)
    if NO_DRAFTS in plan(args, outcome.system):  # named as the system is, for the target to pair them
        ceilings[BARE_ONE + outcome.system.removeprefix(CONTINUOUS)] = run_bare(
            args, workloads["single"], dtype, quantize=quantize
        )
    return outcome


def run_systems(
    args: argparse.Namespace, workloads: dict[str, Workload], known: set[str], ceilings: dict[str, Any]
) -> list[Outcome]:
    """Every server, float32 first; in each further dtype, the three that compete: Conveyor continuous, vLLM
    with every core, transformers serve. The bare forward at batch 1 goes into `ceilings` (`run_continuous`)."""
    outcomes = [
        run_continuous(args, workloads, known, ceilings)
        if mode == "continuous"
        else run_conveyor(args, mode, workloads, known)
        for mode in args.systems
    ]
    outcomes += [run_vllm(args, workloads, binding) for binding in args.vllm_bindings]
    outcomes.append(run_llamacpp(args, workloads))
    outcomes.append(run_transformers(args, workloads))
    for dtype in args.dtypes[1:]:
        outcomes.append(run_continuous(args, workloads, known, ceilings, dtype))
        outcomes.append(run_vllm(args, workloads, "all", dtype))
        outcomes.append(run_llamacpp(args, workloads, dtype))
        outcomes.append(run_transformers(args, workloads, dtype))
    for quantize in args.quantized:  # float32 activations, against llama.cpp's weights of the same width
        outcomes.append(run_continuous(args, workloads, known, ceilings, quantize=quantize))
        outcomes.append(run_llamacpp(args, workloads, quantize))
    return outcomes


def write_outputs(args: argparse.Namespace, outcomes: list[Outcome], summary: dict[str, Any]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for o in outcomes:
        for name, result in o.results.items():
            result.write(args.out / f"{o.system}-{name}.json", detailed=name == "long")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_sitting(args.out, "benchmarks.compare")
    sweeps = [o.results["sweep"].to_dict() for o in outcomes if "sweep" in o.results]
    if sweeps:
        plot_results(sweeps, args.out / "sweep.png", "Latency and throughput against request rate (same prompts)")
    note(f"wrote the results to {args.out}/")


def default_dtypes() -> list[str]:
    """bfloat16 too where oneDNN has bf16 kernels (`CONVEYOR_CPU_BF16=0` leaves it out on any CPU)."""
    return ["float32", "bfloat16"] if cpu.onednn_bf16() else ["float32"]


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


QUICK = {  # a smoke run on a tiny model: every phase, a handful of requests
    "num_prompts": 8,
    "input_len": (8, 32),
    "output_len": (2, 8),
    "max_concurrency": 4,
    "single_prompts": 2,
    "single_output_len": 4,
    "sweep_prompts": 4,
    "sweep_rates": [8.0, float("inf")],
    "short_prompts": 4,
    "short_input_len": (8, 16),
    "short_output_len": 6,
    "long_prompts": 1,
    "long_len": 300,
    "long_output_len": 2,
    "long_rate": 8.0,
    "num_warmups": 1,
    "vllm_bindings": ["all"],
    "gemm_baseline": False,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-id",
        type=names,
        default=list(MODELS),
        help="the models to compare on, in turn, comma-separated: 'real' (SmolLM2-135M-Instruct, prepared by "
        "benchmarks/real_model.py), 'demo' (built by the launcher), a model directory or a Hub id",
    )
    p.add_argument("--demo-size", default="small", help="the demo model's size, with --model-id demo")
    p.add_argument("--systems", type=names, default=list(MODES), help="Conveyor scheduling modes to measure")
    p.add_argument("--skip-transformers", action="store_true", help="leave out `transformers serve`")
    p.add_argument("--skip-vllm", action="store_true", help="leave out vLLM's CPU build")
    p.add_argument("--skip-llamacpp", action="store_true", help="leave out llama.cpp's server")
    p.add_argument(
        "--quantized",
        type=names,
        default=[],
        help="also Conveyor --quantize int8 (int4) against llama.cpp's q8_0 (q4_0) weights, on the same workloads",
    )
    p.add_argument(
        "--vllm-bindings",
        type=names,
        default=list(deploy.VLLM_BINDINGS),
        help="vLLM thread bindings to measure: all (every core for the model), default (vLLM's own)",
    )
    p.add_argument(
        "--dtypes",
        type=names,
        default=default_dtypes(),
        help="float32, and bfloat16 (default only where oneDNN has bf16 kernels for the CPU, unless "
        "CONVEYOR_CPU_BF16=0: elsewhere every bf16 matmul takes a slow fallback)",
    )
    p.add_argument(
        "--no-gemm-baseline",
        dest="gemm_baseline",
        action="store_false",
        help="skip the bare forward on F.linear (MKL), the baseline of the oneDNN GEMM",
    )
    p.add_argument("--skip-bare", action="store_true", help="leave out the bare-forward ceiling")
    p.add_argument("--quick", action="store_true", help="tiny workloads, for a smoke test: " + ", ".join(QUICK))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=64, help="throughput workload: prompts, all sent at once")
    p.add_argument("--input-len", type=length_range, default=(16, 64), metavar="LOW,HIGH", help="prompt tokens")
    p.add_argument("--output-len", type=length_range, default=(128, 128), metavar="LOW,HIGH", help="output tokens")
    p.add_argument(
        "--output-mean",
        type=int,
        default=None,
        help="draw output lengths from an exponential with this mean, clipped to --output-len",
    )
    p.add_argument("--max-concurrency", type=int, default=32, help="client cap; static batch and bare batch size")
    p.add_argument("--single-prompts", type=int, default=8, help="single workload: prompts, one at a time")
    p.add_argument("--single-output-len", type=int, default=64, help="single workload: output tokens")
    p.add_argument("--single-systems", type=names, default=["continuous", VLLM, LLAMACPP])
    p.add_argument("--sweep-prompts", type=int, default=20, help="sweep workload: prompts sent at every rate")
    p.add_argument("--sweep-rates", type=lambda s: [float(x) for x in names(s)], default=[0.5, 1.0, 2.0, 4.0])
    p.add_argument("--sweep-systems", type=names, default=["continuous", VLLM])
    p.add_argument("--short-prompts", type=int, default=24, help="long workload: short streams")
    p.add_argument("--short-input-len", type=length_range, default=(32, 64))
    p.add_argument("--short-output-len", type=int, default=64)
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-len", type=int, default=1900, help="long prompts' tokens")
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-rate", type=float, default=3.0, help="long workload: Poisson arrivals per second")
    p.add_argument("--long-systems", type=names, default=["continuous"])
    p.add_argument("--static-timeout", type=float, default=0.5, help="static mode: seconds a batch waits to fill")
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep Conveyor's prefix cache on (off by default: every rate reuses the same prompts)",
    )
    p.add_argument("--launcher-arg", action="append", default=[], help="one more launcher flag (repeatable)")
    p.add_argument("--tserve-block-size", type=int, default=256, help="transformers serve --cb-block-size")
    p.add_argument("--tserve-max-batch-tokens", type=int, default=4096, help="transformers serve --cb-max-batch-tokens")
    p.add_argument("--num-warmups", type=int, default=4)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="folder for the results: a folder per model in it, named as its directory, with the JSON and the plot",
    )
    args = p.parse_args(argv)
    if args.quick:
        explicit = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv or []) if a.startswith("--")}
        for key, value in QUICK.items():
            if key not in explicit:
                setattr(args, key, value)
    for option, given, allowed in (
        ("--systems", args.systems, MODES),
        ("--dtypes", args.dtypes, DTYPE_SUFFIX),
        ("--vllm-bindings", args.vllm_bindings, deploy.VLLM_BINDINGS),
    ):
        if unknown := set(given) - set(allowed):
            p.error(f"unknown {option} {sorted(unknown)}: choose from {', '.join(allowed)}")
    if not args.model_id or len(set(args.model_id)) != len(args.model_id):
        p.error(f"--model-id names each model once: {args.model_id}")
    if args.dtypes[:1] != ["float32"]:
        p.error("--dtypes starts with float32: every comparison has the float32 run as its reference")
    return args


def resolve(model_id: str, demo_size: str) -> Path:
    """A model's directory: `real` prepared (downloaded and converted the first time), anything else as the
    launcher resolves it."""
    if model_id == REAL:
        return real_model.prepare()
    from conveyor.model_source import resolve_model

    return resolve_model(model_id, demo_size)


def for_model(args: argparse.Namespace, model_id: str) -> argparse.Namespace:
    """The options of one model's comparison: its directory, which every system is given, and a results folder of
    its own under --out, named as the directory (so that one model's run never overwrites another's)."""
    model_dir = resolve(model_id, args.demo_size)
    return argparse.Namespace(
        **{**vars(args), "model_id": model_id, "model_dir": model_dir, "out": args.out / model_dir.name}
    )


def ask(url: str, model: str, question: str, max_tokens: int = CHECK_TOKENS, timeout: float = 600.0) -> str:
    """The served model's greedy answer to `question` through /v1/chat/completions (its chat template applied).
    The standard library's client: one plain request needs no session."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def check_answer(url: str, model: str) -> None:
    """Stops the run unless the served model answers real_model.CHECK_QUESTION sensibly."""
    question, expected = real_model.CHECK_QUESTION, real_model.CHECK_ANSWER
    answer = ask(url, model, question)
    note(f"check: asked {question!r}, {model} answered {answer!r}")
    if expected not in answer:
        raise SystemExit(
            f"the model check failed: asked {question!r} (greedy), {model} answered {answer!r}, which does not "
            f"contain {expected!r}; its preparation is broken, so nothing of it was measured"
        )


def check_model(args: argparse.Namespace) -> None:
    """Before the real model is timed, Conveyor serves it (float32, default scheduling, the --launcher-arg flags)
    and must answer the check question: every system serves this one directory, so a conversion that broke it
    would otherwise be benchmarked silently, by all of them. Random-weight models have nothing to check."""
    if args.model_id != REAL:
        return
    spec = deploy.ConveyorSpec("conveyor-check", args.model_dir, ["--dtype", "float32", *args.launcher_arg])
    with deploy.conveyor(spec, args.startup_timeout) as url:
        check_answer(url, str(args.model_dir))


def compare_model(args: argparse.Namespace) -> bool:
    """One model's whole comparison, written to its folder and printed; whether any system failed."""
    note(f"model {args.model_dir.name}: {args.model_dir}")
    check_model(args)
    read = roofline.read_bandwidth()  # this sitting's plain read, which one stream's weight reads are held to
    note(f"plain read: {read / 1e9:.1f} GB/s")
    workloads = build_workloads(args, load_tokenizer(str(args.model_dir)))
    at_batch_1: dict[str, bare.BareResult | str] = {}
    outcomes = run_systems(args, workloads, deploy.launcher_flags(), at_batch_1)
    ceilings = {**run_ceilings(args, workloads["throughput"]), **at_batch_1}
    summary = summary_dict(args, outcomes, ceilings, workloads)
    weights = roofline.streamed_weights(args.model_dir)
    summary["one_stream_bandwidth"] = {
        "read_gb_s": read / 1e9,
        "weights": weights,
        "systems": one_stream_bandwidth(outcomes, weights, read),
    }
    write_outputs(args, outcomes, summary)
    print_report(args, outcomes, ceilings, summary, workloads)
    return any(o.status == "failed" for o in outcomes)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    failed = False
    for n, model_id in enumerate(args.model_id):
        if n:
            print(flush=True)  # a blank line between the models' reports
        failed |= compare_model(for_model(args, model_id))
    note(f"compare took {time.monotonic() - started:.0f} s")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
