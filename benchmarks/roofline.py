"""The memory-bandwidth roofline of one stream: the least time a decode step can take when it must read every weight.

    .venv/bin/python -m benchmarks.roofline --model-id demo --demo-size 1b

At batch 1 a step reads each weight once and does two flops per weight, so on a CPU it is bound by memory: its
floor is the weights' bytes over the bandwidth a plain read reaches here (a multi-threaded sum over a buffer far
larger than the caches, the best of a few). The embedding table is left out (a step reads one row of it), the
LM head is in. Bytes per weight: 4 (float32), 2 (bf16), 1 + 2/32 (int8: llama.cpp's q8_0 and Conveyor's blocks of
32 with a float16 scale), 0.5 + 2/32 (int4, likewise). The KV cache a step also reads is not counted: at short
contexts it is small beside the weights (say so where it is not).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "int8": 1 + 2 / 32, "int4": 0.5 + 2 / 32}
READ_BYTES = 1 << 30  # 1 GiB: far past any CPU's last-level cache


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second a plain multi-threaded read reaches (the best of `repeats` sums over READ_BYTES)."""
    data = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    data.sum()  # pages touched, threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return READ_BYTES / best


def streamed_weights(model_dir: Path) -> int:
    """Weights a decode step reads: every parameter but the input embedding (the LM head counts, tied or not)."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config["intermediate_size"]
    return layers * (attention + mlp) + config["vocab_size"] * hidden


def roofline(model_dir: Path, bandwidth: float) -> dict[str, float]:
    """Milliseconds per token at the bandwidth, for each width of weights."""
    weights = streamed_weights(model_dir)
    return {dtype: weights * size / bandwidth * 1000 for dtype, size in BYTES_PER_WEIGHT.items()}


def main(argv: list[str] | None = None) -> None:
    from conveyor.model_source import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="demo")
    p.add_argument("--demo-size", default="1b")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here (docs_tables reads it)")
    args = p.parse_args(argv)
    model_dir = resolve_model(args.model_id, args.demo_size)
    bandwidth = read_bandwidth()
    floors, weights = roofline(model_dir, bandwidth), streamed_weights(model_dir)
    print(f"model: {model_dir.name}, {weights / 1e9:.3f}B weights read per step")
    print(f"plain read: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads)")
    for dtype, ms in floors.items():
        print(f"  {dtype:<9} {ms:7.1f} ms/token  ({1000 / ms:5.1f} tok/s at most for one stream)")
    if args.json:
        record = {"model": model_dir.name, "weights": weights, "bandwidth_gb_s": bandwidth / 1e9}
        args.json.write_text(json.dumps({**record, "ms_per_token": floors}, indent=2) + "\n")


if __name__ == "__main__":
    main()
