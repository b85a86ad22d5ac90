"""What a step verifying drafts costs against a plain one on this machine, per dtype: issue 66's k-row ratios.

    .venv/bin/python -m benchmarks.verify_rows                              # SmolLM2-135M-Instruct, every dtype
    .venv/bin/python -m benchmarks.verify_rows --model-id demo --modes float32,int8 --rows 1,2,5

A step verifying k drafts of one sequence feeds k+1 rows through weights it reads once, so where the GEMVs are
bound by memory it costs little more than a one-row step, and where they are bound by computing (widening quantized
weights, many rows) up to k+1 of them. Each mode's engine is loaded as a shard loads it (shard/offline.py), and one
sequence's step at each row count is the one the shard's warmup times for the router's draft choice (`verify_steps`
in shard/step/step_timing.py). Here the counts are timed in interleaved rounds, the best of each kept, so the VM's
swings hit every count alike: the warmup's own median of two is noisier.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

MODES = {  # a mode: the dtype and the weight quantization it loads with
    "float32": ("float32", None),
    "bfloat16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
}
POOL_TOKENS = 128  # the KV pool: the context and the largest step


def best_seconds(steps: dict[int, Callable[[], object]], rounds: int, calls: int) -> dict[int, float]:
    """Seconds of each step, the best over `rounds` rounds that each run every count once untimed, then `calls`
    times timed."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for count, step in steps.items():
            step()
            start = time.perf_counter()
            for _ in range(calls):
                step()
            best[count] = min(best[count], (time.perf_counter() - start) / calls)
    return best


@torch.inference_mode()
def measure(model_dir: Path, mode: str, rows: Sequence[int], rounds: int, calls: int) -> dict[int, float]:
    from conveyor.shard import offline

    dtype, quantize = MODES[mode]
    engine = offline.load(model_dir, dtype, quantize)
    engine.cache = engine.allocate(math.ceil(POOL_TOKENS / engine.block_size))
    steps = offline.verify_steps(engine, rows)
    if steps is None:
        raise SystemExit(f"a pool of {POOL_TOKENS} tokens cannot hold {max(rows)} rows after the context")
    return best_seconds(steps, rounds, calls)


def main(argv: list[str] | None = None) -> None:
    from benchmarks import real_model
    from conveyor.model_source import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="real", help="'real' (SmolLM2-135M-Instruct), 'demo' or a model directory")
    p.add_argument("--demo-size", default="small")
    p.add_argument("--modes", default=",".join(MODES), help=f"some of {', '.join(MODES)}")
    p.add_argument("--rows", default="1,2,4,5,8", help="row counts; the first is what the others are divided by")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--calls", type=int, default=3, help="timed calls per count and round")
    p.add_argument("--json", type=Path, default=None, help="also write the seconds and ratios here")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}: choose from {list(MODES)}")
    rows = [int(r) for r in args.rows.split(",")]
    if not rows or min(rows) < 1 or max(rows) > POOL_TOKENS // 2:
        p.error(f"--rows takes counts from 1 to {POOL_TOKENS // 2}")
    model_dir = real_model.prepare() if args.model_id == "real" else resolve_model(args.model_id, args.demo_size)
    print(f"model: {model_dir.name}; one sequence, {len(rows)} row counts, {args.rounds} interleaved rounds")
    record = {}
    for mode in modes:
        seconds = measure(model_dir, mode, rows, args.rounds, args.calls)
        base = seconds[rows[0]]
        ratios = {count: seconds[count] / base for count in rows}
        record[mode] = {"seconds": seconds, "ratio": ratios}
        shown = "  ".join(f"{count}: {ratio:.2f}" for count, ratio in ratios.items())
        print(f"  {mode:<9} {rows[0]} row(s) {base * 1000:6.1f} ms   ratios  {shown}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": model_dir.name, "rows": rows, "modes": record}, indent=2) + "\n")


if __name__ == "__main__":
    main()
