"""Which oneDNN implementation a packed linear layer runs on this machine, per dtype and row count: the ISA oneDNN
chose (`avx2`, `avx512_core`, `avx512_core_amx` for the tiles...), recorded beside each benchmark figure so that a
bf16 sitting on an AMX Xeon says whether its products reached the tiles.

oneDNN names what it runs in its verbose log (`ONEDNN_VERBOSE=1`), which it writes to stdout as it creates and runs
primitives: a child process runs one packed linear per dtype and row count, each after a marker line, and the first
matmul line after a marker is that product's implementation. The child inherits the environment, so
`ONEDNN_MAX_CPU_ISA` or `CONVEYOR_CPU_VARIANT` caps show in the report as they apply to the shards.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any

ROWS = (1, 8, 32, 512)  # one stream, a few, a full decode batch, a prompt
MARK = "conveyor-onednn-report"
CHILD = f"""
import sys, torch
from conveyor import cpu
dtypes = [torch.float32] + ([torch.bfloat16] if cpu.onednn_bf16() else [])
for dtype in dtypes:
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(256, 512).to(dtype))
    for rows in {ROWS!r}:
        print("{MARK}", str(dtype).removeprefix("torch."), rows, flush=True)
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 512).to(dtype), weight, None, "none", [], "")
        sys.stdout.flush()
"""


@functools.cache
def report() -> dict[str, Any]:
    """{"isa": oneDNN's ISA line, "<dtype>": {"<rows>": implementation}}; {"error": ...} if the child failed."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return parse(done.stdout)


def parse(log: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    current: tuple[str, str] | None = None
    for line in log.splitlines():
        fields = line.split(",")
        if line.startswith(MARK):
            _, dtype, rows = line.split()
            current = (dtype, rows)
        elif "isa:" in line and "info" in fields:
            out["isa"] = line.split("isa:", 1)[1].strip()
        elif current is not None and "exec" in fields and _is_matmul(fields):
            out.setdefault(current[0], {})[current[1]] = fields[fields.index("exec") + 3]
            current = None
    return out


def _is_matmul(fields: list[str]) -> bool:
    at = fields.index("exec")
    return len(fields) > at + 3 and fields[at + 2] in ("inner_product", "matmul")


def summary(found: dict[str, Any]) -> str:
    """One line: the ISA and each dtype's implementation at a full decode batch (32 rows)."""
    if "error" in found:
        return f"oneDNN report failed: {found['error']}"
    kinds = ", ".join(f"{d} {rows.get('32', '?')}" for d, rows in found.items() if isinstance(rows, dict))
    return f"oneDNN {found.get('isa', '?')} ({kinds} at 32 rows)"
