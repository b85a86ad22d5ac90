"""A run's requests turned into vLLM's serving metrics, and the records that hold them.

Definitions follow vLLM's benchmark: throughputs are over the wall duration of the run (first send to last
answer), latency statistics are over successful requests only, TPOT only over outputs longer than one token,
ITL over every gap of every request, and goodput counts the requests that meet every given SLO. Failed requests
are counted and their errors kept.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.client import RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "p99")
SLO_METRICS = ("ttft", "tpot", "e2el")
MAX_ERRORS = 10  # distinct error messages kept per run


@dataclass(frozen=True)
class Summary:
    """Mean, median and 99th percentile, in milliseconds; None when there was nothing to measure."""

    mean: float | None = None
    median: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, seconds: list[float]) -> Summary:
        if not seconds:
            return cls()
        ms = np.asarray(seconds) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


@dataclass
class RateResult:
    """One request rate of a run: the aggregate numbers, and the per-request records they came from."""

    request_rate: float
    burstiness: float
    max_concurrency: int | None
    duration_s: float
    num_prompts: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None  # None when no SLO was given
    latencies: dict[str, Summary]
    errors: dict[str, int] = field(default_factory=dict)  # message: count
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        """Flat, with vLLM's key names (`median_ttft_ms`, ...); the rate is a number or the string "inf"."""
        out: dict[str, Any] = {
            "request_rate": "inf" if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "duration_s": self.duration_s,
            "num_prompts": self.num_prompts,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "request_goodput": self.request_goodput,
        }
        for name, summary in self.latencies.items():
            for stat in STATISTICS:
                out[f"{stat}_{name}_ms"] = getattr(summary, stat)
        out["errors"] = self.errors
        if detailed:
            out["requests"] = [r.to_dict() for r in self.records]
        return out


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Every given SLO met; a one-token output has no TPOT and so cannot miss that one."""
    measured = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.e2el}
    return all(measured[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def summarize(
    records: list[RequestRecord],
    duration: float,
    rate: float,
    burstiness: float,
    max_concurrency: int | None,
    slos_ms: dict[str, float],
) -> RateResult:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    duration = max(duration, 1e-9)
    latencies = {
        "ttft": Summary.of([r.ttft for r in ok]),
        "tpot": Summary.of([t for r in ok if (t := r.tpot) is not None]),
        "itl": Summary.of([gap for r in ok for gap in r.itl]),
        "e2el": Summary.of([r.e2el for r in ok]),
    }
    goodput = sum(meets_slos(r, slos_ms) for r in ok) / duration if slos_ms else None
    errors = dict(Counter(r.error or "unknown" for r in failed).most_common(MAX_ERRORS))
    return RateResult(
        rate,
        burstiness,
        max_concurrency,
        duration,
        len(records),
        len(ok),
        len(failed),
        total_in,
        total_out,
        len(ok) / duration,
        total_out / duration,
        (total_in + total_out) / duration,
        goodput,
        latencies,
        errors,
        records,
    )


@dataclass
class BenchmarkResult:
    """One system under one workload, at each request rate: what `--json` writes and `plot` reads."""

    label: str
    backend: str
    base_url: str
    model: str
    workload: dict[str, Any]
    runs: list[RateResult]

    def to_dict(self, detailed: bool = False) -> dict[str, Any]:
        return {
            "label": self.label,
            "backend": self.backend,
            "base_url": self.base_url,
            "model": self.model,
            "workload": self.workload,
            "runs": [r.to_dict(detailed) for r in self.runs],
        }

    def to_json(self, detailed: bool = False) -> str:
        return json.dumps(self.to_dict(detailed), indent=2) + "\n"

    def write(self, path: Path, detailed: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(detailed))


def rate_value(raw: float | str) -> float:
    """A request rate as JSON holds it ("inf" or a number) back to a float."""
    return float(raw)


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """Result files as dicts (the plot reads the same shape `to_dict` gives)."""
    return [json.loads(Path(p).read_text()) for p in paths]
