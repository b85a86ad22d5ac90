"""One PNG comparing systems across request rates: output throughput and p50/p99 latencies, one line per system.

Rates sit on a categorical axis (the union of every system's rates, "inf" last), so runs that sent everything
at once plot beside the finite rates. p50 is the solid line, p99 the dashed one, in the system's colour.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.metrics import rate_value

PANELS = (  # (title, y label, keys: (median-like, tail) or a single throughput key)
    ("Output throughput", "tokens / s", ("output_throughput",)),
    ("Time to first token", "ms", ("median_ttft_ms", "p99_ttft_ms")),
    ("Inter-token latency", "ms", ("median_itl_ms", "p99_itl_ms")),
    ("End-to-end latency", "ms", ("median_e2el_ms", "p99_e2el_ms")),
)


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def plot_results(results: list[dict[str, Any]], out: Path, title: str | None = None) -> Path:
    """Draws `results` (each a `BenchmarkResult.to_dict()`) into `out`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    rates = sorted({rate_value(run["request_rate"]) for r in results for run in r["runs"]})
    position = {rate: i for i, rate in enumerate(rates)}
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (panel_title, unit, keys), ax in zip(PANELS, axes.flat):
        for n, result in enumerate(results):
            runs = sorted(result["runs"], key=lambda run: rate_value(run["request_rate"]))
            xs = [position[rate_value(run["request_rate"])] for run in runs]
            for key, style in zip(keys, ("-", "--")):
                ys = [run.get(key) if run.get(key) is not None else math.nan for run in runs]
                label = result["label"] if style == "-" else None  # one legend entry per system
                ax.plot(xs, ys, style, marker="o", color=colours[n % len(colours)], label=label)
        ax.set_title(panel_title if len(keys) == 1 else f"{panel_title} (p50 solid, p99 dashed)")
        ax.set_ylabel(unit)
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "Serving benchmark: " + ", ".join(r["label"] for r in results))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
