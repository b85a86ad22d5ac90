"""Starting and stopping the systems `compare` measures: Conveyor through its launcher, and `transformers serve`.

Each is a context manager that yields the base URL once /health answers and always stops the process, keeping
its output in a log file whose tail explains any failure. The launcher helpers (ports, health polling, ordered
SIGTERM) are `engines.py`'s.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

from conveyor.benchmarks import engines
from conveyor.benchmarks.engines import DeploymentFailed  # noqa: F401 - callers catch it from here


def launcher_flags() -> set[str]:
    """The flags this checkout's launcher knows (from its --help), so that newer ones are used only when present."""
    from conveyor.launcher import main as launcher

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        launcher.parse_args(["--help"])
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.getvalue()))


@dataclass(frozen=True)
class ConveyorSpec:
    """One Conveyor deployment: a scheduling mode and the launcher flags it takes."""

    name: str  # e.g. conveyor-continuous
    model_dir: Path
    flags: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _logged(prefix: str) -> Iterator[tuple[Path, io.BufferedWriter]]:
    with tempfile.NamedTemporaryFile(prefix=f"conveyor-bench-{prefix}-", suffix=".log", delete=False) as log:
        yield Path(log.name), log


def _serve(command: list[str], name: str, port: int, timeout: float) -> Iterator[str]:
    """Runs `command`, yields its URL once healthy, stops it; the log is kept only when something failed."""
    url = f"http://127.0.0.1:{port}"
    with _logged(name) as (log_path, log):
        engines.progress(f"starting {name} on port {port} (output: {log_path})")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    failed = True
    try:
        engines.wait_healthy(process, url, timeout, log_path)
        yield url
        failed = False
    finally:
        engines.stop(process)
        if not failed:
            log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def conveyor(spec: ConveyorSpec, timeout: float) -> Iterator[str]:
    port, master_port = engines.free_ports(2)
    launcher_args = SimpleNamespace(model_id=str(spec.model_dir), max_batch_total_tokens=None, launcher_arg=spec.flags)
    command = engines.launcher_command(launcher_args, "paged", 1, port, master_port)
    yield from _serve(command, spec.name, port, timeout)


def transformers_cli() -> str | None:
    """The `transformers` command next to this Python (the venv's), else on PATH; None when not installed."""
    local = Path(sys.executable).with_name("transformers")
    return str(local) if local.exists() else shutil.which("transformers")


def transformers_serve_problem() -> str | None:
    """Why `transformers serve` cannot run here, or None when it can."""
    if transformers_cli() is None:
        return "the `transformers` command is not installed"
    for module in ("fastapi", "uvicorn"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install 'transformers[serving]', or `make bench`)"
    return None


@contextlib.contextmanager
def transformers_serve(model_dir: Path, num_blocks: int, block_size: int, max_batch_tokens: int,
                       timeout: float) -> Iterator[str]:  # fmt: skip
    """`transformers serve DIR --continuous-batching` on CPU, pinned to the model (it then serves only that)."""
    (port,) = engines.free_ports(1)
    command = [transformers_cli() or "transformers", "serve", str(model_dir), "--continuous-batching",
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--cb-num-blocks", str(num_blocks),
               "--cb-block-size", str(block_size), "--cb-max-batch-tokens", str(max_batch_tokens),
               "--log-level", "warning"]  # fmt: skip
    yield from _serve(command, "transformers-serve", port, timeout)
