"""Output tokens per second for 1 vs 2 tensor-parallel shards, at several concurrencies, in one run.

    .venv/bin/python benchmarks/shards.py                       # the demo model, the full grid (many minutes on CPU)
    .venv/bin/python benchmarks/shards.py --model-id DIR --requests 4 --shards 1 --concurrency 1,2 --max-new-tokens 4

Every deployment (one per shard count) is started here with the launcher, warmed up, then sent the same seeded
prompt set at each concurrency (every request streams exactly --max-new-tokens tokens, EOS ignored), then
stopped with SIGTERM. Model, prompts and token counts are identical across the grid, so the numbers differ
only in the number of shards; with both 1 and 2 in the grid a last row gives 2 shards / 1 shard at each level.
A deployment that fails is reported (its launcher output goes to stderr), shown as "failed", and the rest of
the grid still runs; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 4
STOP_TIMEOUT_S = 180.0  # the launcher gives in-flight requests 60 s, then stops each shard (10 s each at most)
LOG_TAIL_LINES = 60
RATIO_LABEL = "2 shards / 1 shard"  # the last row of the table, when the grid holds both
LABEL_WIDTH = len(RATIO_LABEL) + 2


def load_sibling(name: str) -> ModuleType:
    """Imports benchmarks/<name>.py by path: benchmarks/ is not a package, and loading the file itself (rather
    than putting the folder on sys.path) cannot pick up or shadow some other module of the same name."""
    spec = importlib.util.spec_from_file_location(f"conveyor_benchmarks_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here while the file executes
    spec.loader.exec_module(module)
    return module


streams = load_sibling("streams")  # run_level, prompts and Row: the same client and numbers as streams.py


class DeploymentFailed(RuntimeError):
    """A deployment that did not start or did not finish its levels; the message carries the launcher's output."""


@dataclass
class Outcome:
    """What one deployment (shard count) of the grid came to: rows by concurrency, or why there are none."""

    shards: int
    rows: dict[int, streams.Row] = field(default_factory=dict)  # by concurrency
    status: str = "ok"  # ok | failed
    error: str | None = None


def progress(message: str) -> None:
    """Progress goes to stderr so that stdout holds nothing but the results."""
    print(message, file=sys.stderr, flush=True)


def free_ports(count: int) -> list[int]:
    """Ports the kernel picks (bind to port 0); all sockets are held open together so the ports are distinct."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launcher_command(args: argparse.Namespace, shards: int, port: int, master_port: int) -> list[str]:
    """The launcher's command line; flags forwarded by the user come last, so that they win."""
    command = [
        sys.executable,
        "-m",
        "conveyor.launcher.main",
        "--model-id",
        args.model_id,
        "--port",
        str(port),
        "--master-port",
        str(master_port),
        "--num-shard",
        str(shards),
    ]
    if args.max_batch_total_tokens is not None:
        command += ["--max-batch-total-tokens", str(args.max_batch_total_tokens)]
    return command + list(args.launcher_arg)


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The end of the launcher's output, verbatim: what explains a failure is nearly always there."""
    text = log_path.read_text(errors="replace").rstrip("\n").splitlines()
    return "\n".join(text[-lines:]) if text else "(the launcher wrote nothing)"


def healthy(url: str) -> bool:
    """GET /health answers 200 only once the router and every shard are ready."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # refused while starting, or 503 (HTTPError) until ready
        return False


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    """Polls /health until the deadline, failing at once (with the launcher's output) if the launcher exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeploymentFailed(
                f"the launcher exited with code {process.returncode} while starting; "
                f"its output ({log_path}):\n{log_tail(log_path)}"
            )
        if healthy(url):
            return
        time.sleep(0.5)
    raise DeploymentFailed(
        f"not healthy after {timeout:.0f} s; the launcher's output ({log_path}):\n{log_tail(log_path)}"
    )


def stop(process: subprocess.Popen) -> None:
    """SIGTERM lets the launcher stop router and shards in order; SIGKILL only if it hangs (shards may outlive it)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        progress(f"  the launcher (pid {process.pid}) ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it")
        process.kill()
        process.wait()


async def run_levels(
    url: str, texts: list[str], levels: list[int], max_new_tokens: int, level_timeout: float
) -> dict[int, streams.Row]:
    """A short warm-up (first requests pay one-off costs), then every level on the same prompts, in one loop."""
    progress(f"  warming up with {min(WARMUP_REQUESTS, len(texts))} requests...")
    warmup = texts[:WARMUP_REQUESTS]
    await asyncio.wait_for(streams.run_level(url, warmup, len(warmup), WARMUP_TOKENS), level_timeout)
    rows = {}
    for c in levels:
        progress(f"  {len(texts)} requests, {c} at a time...")
        rows[c] = await asyncio.wait_for(streams.run_level(url, texts, c, max_new_tokens), level_timeout)
        progress(f"    {rows[c].tok_per_s:.1f} output tok/s")
    return rows


def measure(args: argparse.Namespace, shards: int, texts: list[str]) -> dict[int, streams.Row]:
    """Starts one deployment, measures it, and always stops it; its output is kept in a log file on failure."""
    port, master_port = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix=f"conveyor-bench-x{shards}-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        progress(f"starting {shards} shard(s) on port {port} (launcher output: {log_path})")
        process = subprocess.Popen(
            launcher_command(args, shards, port, master_port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_healthy(process, url, args.startup_timeout, log_path)
        rows = asyncio.run(run_levels(url, texts, args.concurrency, args.max_new_tokens, args.level_timeout))
    except DeploymentFailed:
        raise
    except Exception as exc:  # a request error or timeout: the launcher's output may say why
        raise DeploymentFailed(
            f"{type(exc).__name__}: {exc}; the launcher's output ({log_path}):\n{log_tail(log_path)}"
        ) from exc
    finally:
        stop(process)
    log_path.unlink(missing_ok=True)
    return rows


def run_grid(args: argparse.Namespace, texts: list[str]) -> list[Outcome]:
    """Every shard count in order; a failure is recorded and reported, and the grid goes on."""
    outcomes = []
    for shards in args.shards:
        outcome = Outcome(shards)
        try:
            outcome.rows = measure(args, shards, texts)
        except DeploymentFailed as exc:
            outcome.status, outcome.error = "failed", str(exc)
            progress(f"FAILED: {shards} shard(s): {exc}")
        outcomes.append(outcome)
    return outcomes


def cell(outcome: Outcome, concurrency: int) -> str:
    """One table cell: the measured rate, or why there is none (failed)."""
    row = outcome.rows.get(concurrency)
    return f"{row.tok_per_s:.1f}" if row is not None else outcome.status


def ratio_cells(outcomes: list[Outcome], levels: list[int]) -> list[str] | None:
    """2 shards / 1 shard at each level ("n/a" where either failed); None when the grid lacks one of the two."""
    by_shards = {o.shards: o for o in outcomes}
    two, one = by_shards.get(2), by_shards.get(1)
    if two is None or one is None:
        return None
    cells = []
    for c in levels:
        a, b = two.rows.get(c), one.rows.get(c)
        cells.append(f"{a.tok_per_s / b.tok_per_s:.2f}x" if a is not None and b is not None else "n/a")
    return cells


def print_report(args: argparse.Namespace, outcomes: list[Outcome]) -> None:
    """Parameters first, then one row per deployment and one column per concurrency; the ratio row last."""
    print(f"model: {args.model_id}" + (f"; launcher args: {' '.join(args.launcher_arg)}" if args.launcher_arg else ""))
    budget = f"; --max-batch-total-tokens {args.max_batch_total_tokens}" if args.max_batch_total_tokens else ""
    print(
        f"prompt set: {args.requests} prompts of {args.min_words}-{args.max_words} words, seed {args.seed}, "
        f"{args.max_new_tokens} new tokens each (EOS ignored), same prompts at every level{budget}"
    )
    width = max(10, *(len(f"{c} streams") + 2 for c in args.concurrency))
    print(
        f"\noutput tok/s by concurrent streams\n{'shards':<{LABEL_WIDTH}}"
        + "".join(f"{f'{c} streams':>{width}}" for c in args.concurrency)
    )
    for o in outcomes:
        print(f"{o.shards:<{LABEL_WIDTH}}" + "".join(f"{cell(o, c):>{width}}" for c in args.concurrency))
    ratios = ratio_cells(outcomes, args.concurrency)
    if ratios is not None:
        print(f"{RATIO_LABEL:<{LABEL_WIDTH}}" + "".join(f"{r:>{width}}" for r in ratios))


def write_json(path: Path, args: argparse.Namespace, outcomes: list[Outcome]) -> None:
    """The raw numbers, with the parameters that produced them, for later comparison across runs."""
    raw = {
        "model_id": args.model_id,
        "seed": args.seed,
        "requests": args.requests,
        "min_words": args.min_words,
        "max_words": args.max_words,
        "max_new_tokens": args.max_new_tokens,
        "concurrency": args.concurrency,
        "max_batch_total_tokens": args.max_batch_total_tokens,
        "launcher_args": args.launcher_arg,
        "deployments": [
            {
                "shards": o.shards,
                "status": o.status,
                "error": o.error,
                "levels": [dict(asdict(r), tok_per_s=r.tok_per_s) for r in o.rows.values()],
            }
            for o in outcomes
        ],
    }
    path.write_text(json.dumps(raw, indent=2) + "\n")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-id", default="demo", help="a model directory, or 'demo' (built by the launcher)")
    p.add_argument("--shards", default="1,2", type=int_list, help="tensor-parallel shard counts, one deployment each")
    p.add_argument("--concurrency", default="1,8,32", type=int_list, help="requests in flight at once, per level")
    p.add_argument("--requests", type=int, default=32, help="prompts sent at every level (the same ones)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens each request streams (EOS ignored)")
    p.add_argument("--min-words", type=int, default=10)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt set")
    p.add_argument("--max-batch-total-tokens", type=int, default=None, help="forwarded to the launcher")
    p.add_argument(
        "--launcher-arg",
        action="append",
        default=[],
        help="one more launcher argument (repeatable), e.g. --launcher-arg=--dtype=bfloat16",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a deployment to be healthy")
    p.add_argument("--level-timeout", type=float, default=3600.0, help="seconds one concurrency level may take")
    p.add_argument("--json", type=Path, default=None, help="also write the raw numbers here")
    args = p.parse_args(argv)
    if args.requests < 1 or args.max_new_tokens < 1 or not args.concurrency or min(args.concurrency) < 1:
        p.error("--requests, --max-new-tokens and every --concurrency must be at least 1")
    if not args.shards or min(args.shards) < 1:
        p.error("every --shards must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    texts = streams.prompts(args.requests, args.seed, args.min_words, args.max_words)
    outcomes = run_grid(args, texts)
    print_report(args, outcomes)
    if args.json:
        write_json(args.json, args, outcomes)
    if any(o.status == "failed" for o in outcomes):
        sys.exit(1)


if __name__ == "__main__":
    main()
