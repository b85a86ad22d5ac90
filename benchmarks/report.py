"""The result table on stdout: one column per request rate, one row per metric, so any number of rates fits."""

from __future__ import annotations

import math
from collections.abc import Callable

from benchmarks.metrics import LATENCIES, STATISTICS, BenchmarkResult, RateResult

LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def rows(has_goodput: bool) -> list[tuple[str, Callable[[RateResult], str]]]:
    table: list[tuple[str, Callable[[RateResult], str]]] = [
        ("completed / failed", lambda r: f"{r.completed} / {r.failed}"),
        ("duration (s)", lambda r: number(r.duration_s, 2)),
        ("input tokens", lambda r: str(r.total_input_tokens)),
        ("output tokens", lambda r: str(r.total_output_tokens)),
        ("request throughput (req/s)", lambda r: number(r.request_throughput, 2)),
        ("output throughput (tok/s)", lambda r: number(r.output_throughput)),
        ("total throughput (tok/s)", lambda r: number(r.total_token_throughput)),
    ]
    if has_goodput:
        table.append(("request goodput (req/s)", lambda r: number(r.request_goodput, 2)))
    for name in LATENCIES:
        for stat in STATISTICS:
            table.append((f"{LABELS[name]} {stat} (ms)", lambda r, n=name, s=stat: number(getattr(r.latencies[n], s))))
    return table


def format_result(result: BenchmarkResult) -> str:
    """The heading (system, endpoint, workload), the table, then any errors the failed requests gave."""
    w = result.workload
    lines = [
        f"{result.label}: {result.backend} at {result.base_url}, model {result.model}",
        f"workload: {w['num_prompts']} prompts, input {w['input_len']}, output {w['output_len']}, seed "
        f"{w['seed']}, burstiness {w['burstiness']:g}, max concurrency {w['max_concurrency'] or 'none'}",
    ]
    heads = [f"rate {'inf' if math.isinf(r.request_rate) else f'{r.request_rate:g}'}" for r in result.runs]
    table = rows(bool(w.get("goodput_slos_ms")))
    first = max(len(name) for name, _ in table)
    cells = [[cell(r) for r in result.runs] for _, cell in table]
    width = max([len(h) for h in heads] + [len(c) for row in cells for c in row]) + 2
    lines.append(f"{'':<{first}}" + "".join(f"{h:>{width}}" for h in heads))
    for (name, _), row in zip(table, cells):
        lines.append(f"{name:<{first}}" + "".join(f"{c:>{width}}" for c in row))
    for r in result.runs:
        for message, count in r.errors.items():
            lines.append(f"errors at {heads[result.runs.index(r)]}: {count} x {message}")
    return "\n".join(lines)
