"""Shared fixtures: the tiny test model (built once per session) and live deployments started with the launcher;
and the loopback guard (tests/loopback.py), which holds the test process to loopback from collection on."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import loopback
import pytest
import sseclient
from chat_templates import CHAT_TEMPLATES

from conveyor import demo_model

# The probe prompt whose greedy continuation ends on the extra EOS id the test model declares.
EOS_PROBE_PROMPT = "def main():"
EOS_PROBE_MIN_STEP = 4


# Prompts of many lengths with their max_new_tokens, for the oracle tests.
ORACLE_PROMPTS = [
    ("def add(a, b):", 24),
    ("import os", 6),
    ("class Queue:\n    def __init__(self):\n        self.items = []", 30),
    ("x", 12),
    ("for i in range(10):\n    print(i)", 18),
    ("# A long comment that goes on and on about nothing in particular, " * 4, 9),
    ("return None", 40),
    ("while True:", 3),
    ("from collections import deque\nfrom dataclasses import dataclass\n\n@dataclass\nclass Entry:", 15),
    ("print('hello, world')", 27),
    ("try:\n    pass\nexcept Exception as exc:", 1),
    ("lambda", 21),
    ("async def main():\n    await asyncio.sleep(1)", 33),
    ("if __name__ == '__main__':", 11),
]


_LOOPBACK_GUARD = pytest.MonkeyPatch()


# Every launcher this run started. A run ended by SIGTERM (`timeout`, `kill`) would otherwise leave the deployments
# it shares across tests serving, with their memory, after it: they are stopped on the way out.
_LAUNCHERS: list[subprocess.Popen] = []


def _stop_launchers(*_: object) -> None:
    for process in _LAUNCHERS:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the launcher stops its shards and router in order


def _ended(signum: int, frame: object) -> None:
    """SIGTERM: the launchers stop, then pytest ends the session as on Ctrl-C (its teardowns run)."""
    _stop_launchers()
    raise KeyboardInterrupt


def _one_tls_context(build: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    """httpx builds a new TLS context, reading certifi's whole CA bundle (~37 ms of CPU), for every top-level call
    (`httpx.get`, ...) and every client, plain http:// included. The suite makes thousands to loopback, and each
    start's /health poll made ~20 a second, on the 2 cores its deployments need: the default one is built once."""
    default = build()

    def create(verify: object = True, cert: object = None, trust_env: bool = True) -> ssl.SSLContext:
        return default if verify is True and cert is None and trust_env else build(verify, cert, trust_env)

    return create


def pytest_configure(config: pytest.Config) -> None:
    loopback.install(_LOOPBACK_GUARD)
    transports = httpx._transports.default
    _LOOPBACK_GUARD.setattr(transports, "create_ssl_context", _one_tls_context(transports.create_ssl_context))
    signal.signal(signal.SIGTERM, _ended)


def pytest_unconfigure(config: pytest.Config) -> None:
    _LOOPBACK_GUARD.undo()
    _stop_launchers()


@pytest.fixture(autouse=True)
def loopback_only() -> Iterator[None]:
    """Fails the test that sent, or tried to send, traffic off loopback, even where a library swallowed the
    refusal (a health poll that retries until its deadline, say)."""
    first = len(loopback.refused)
    yield
    assert not loopback.refused[first:], f"traffic off loopback: {loopback.refused[first:]}"


@dataclass(frozen=True)
class EosProbe:
    prompt: str
    step: int  # the probe's greedy continuation ends on an EOS at this (1-based) step


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Waits until `condition()` holds; tests synchronise on conditions with a deadline, never on sleeps."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def greedy_reference(model_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """What transformers' own `generate()` yields for this prompt alone: the oracle (computed once per session)."""
    import torch

    key = (model_dir, prompt, max_new_tokens)
    if key not in _REFERENCES:
        model, tokenizer = _load(model_dir)
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        with torch.inference_mode(), one_torch_thread():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        _REFERENCES[key] = out[0, ids.shape[1] :].tolist()
    return list(_REFERENCES[key])


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """This process's torch on one thread meanwhile. A test model's reference (a `generate()`, a forward) is too
    small to gain from a second thread, and on 2 cores shared with the deployments' processes, torch's threads
    waiting on each other made it ~10x slower (150 tokens of the tiny model: 21 s on 2 threads, 1.8 s on one, the
    same tokens). The deployments keep their own threads."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_LOADED: dict[Path, tuple] = {}
_REFERENCES: dict[tuple[Path, str, int], list[int]] = {}
# Where the oracle's reference runs: on the GPU machine the check (benchmarks/gpu/run.sh) sets cuda, and the
# deployments, whose --device is auto, run there too; the same tests then prove the CUDA path.
TEST_DEVICE = os.environ.get("CONVEYOR_TEST_DEVICE", "cpu")
# On that one GPU every deployment of the session shares the memory, and a shard's KV pool takes 90% of what is
# free when it starts: each is bounded there, so that the ones started after it still fit.
GPU_POOL_TOKENS = "32768"


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir not in _LOADED:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
        _LOADED[model_dir] = (model, AutoTokenizer.from_pretrained(model_dir))
    return _LOADED[model_dir]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model, with one ordinary token declared as a second EOS id (as Llama 3 declares several),
    chosen so that the probe prompt's greedy continuation ends on it: random weights never pick `</s>`."""
    path = demo_model.ensure(tmp_path_factory.mktemp("models") / "tiny", "tiny")
    config_path = path / "generation_config.json"
    config = json.loads(config_path.read_text())
    base_eos = config["eos_token_id"]
    probe = greedy_reference(path, EOS_PROBE_PROMPT, 30)
    # A token no other test prompt's continuation contains, so that only the probe stops early.
    others = {t for prompt, n in ORACLE_PROMPTS for t in greedy_reference(path, prompt, n)}
    step = next(
        k for k in range(EOS_PROBE_MIN_STEP, 30) if probe[k - 1] not in probe[: k - 1] and probe[k - 1] not in others
    )
    config["eos_token_id"] = [base_eos, probe[step - 1]]
    config_path.write_text(json.dumps(config, indent=2))
    (path / "eos_probe.json").write_text(json.dumps({"prompt": EOS_PROBE_PROMPT, "step": step}))
    _LOADED.clear()  # the model changed (a second EOS id): load it again, and compute references again
    _REFERENCES.clear()
    return path


@pytest.fixture(scope="session")
def qwen2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-style model (biases on q/k/v). Seed 3 keeps every greedy choice of the oracle prompts at
    least 2e-4 ahead of the runner-up, far above the 1e-6 by which batching may move a logit."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "qwen2", "tiny", seed=3, arch="qwen2")


@pytest.fixture(scope="session")
def qwen3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-style model: per-head q/k RMSNorm, a head size twice hidden / heads."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "qwen3", "tiny", seed=3, arch="qwen3")


@pytest.fixture(scope="session")
def mistral_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Mistral-style model whose sliding window (16 tokens) is shorter than every oracle prompt with its
    generation: each layer attends to the last 16 positions only."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "mistral", "tiny", seed=3, arch="mistral")


@pytest.fixture(scope="session")
def phi3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Phi-4-mini-style model: fused q/k/v and gate/up in the checkpoint, half of each head rotating,
    LongRoPE switching at 100 tokens (one oracle prompt is longer)."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "phi3", "tiny", seed=3, arch="phi3")


@pytest.fixture(scope="session")
def gemma3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma-3-like model: a 16-token windowed layer and a global one, each with its own rope, Gemma's
    norms, q/k norms, scaled embeddings, GeLU MLP, tied embeddings."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "gemma3", "tiny", seed=3, arch="gemma3")


@pytest.fixture(scope="session")
def gemma3_multimodal_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same text network inside Gemma 3's image-text wrapper (`model_type` gemma3, a vision tower beside it),
    as Gemma 3 4B and larger ship."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "gemma3mm", "tiny", seed=3, arch="gemma3-multimodal")


@pytest.fixture(scope="session")
def smolvlm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny SmolVLM (`model_type` idefics3): the Llama text network beside a SigLIP-style tower and the
    pixel-shuffle connector, with SmolVLM's processor splitting an image into tiles."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "smolvlm", "tiny", seed=3, arch="idefics3")


@pytest.fixture(scope="session")
def gemma2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma-2-like model: Gemma 3's layout without q/k norms, one rope, soft-capped scores and logits."""
    return demo_model.ensure(tmp_path_factory.mktemp("models") / "gemma2", "tiny", seed=3, arch="gemma2")


# LoRA adapters for the tiny model, as PEFT saves them, by name. init_lora_weights=False draws B at random (PEFT's
# default leaves it zero: no change at all); on the tiny model that changes every greedy continuation from its first
# token (tests/unit/test_lora.py asserts each adapter changes the output).
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_ADAPTERS = {
    "qv": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 16, "lora_alpha": 8, "target_modules": ALL_PROJECTIONS, "use_rslora": True},
}


def save_lora_adapter(model_dir: Path, out_dir: Path, seed: int = 0, **config) -> Path:
    """A PEFT LoRA adapter for the model in `model_dir` (LoraConfig's arguments; A and B random, seeded), saved
    into `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **config)).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def lora_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's LoRA adapters (LORA_ADAPTERS) by name, each a PEFT adapter directory."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: save_lora_adapter(tiny_model, root / name, seed=n, **config)
        for n, (name, config) in enumerate(LORA_ADAPTERS.items())
    }


@pytest.fixture(scope="session")
def eos_probe(tiny_model: Path) -> EosProbe:
    return EosProbe(**json.loads((tiny_model / "eos_probe.json").read_text()))


@pytest.fixture(scope="session")
def text_eos(tiny_model: Path) -> str:
    """The text of the ordinary token the tiny model declares as a second EOS id (" >="). Where a grammar may end,
    it allows EOS, and this one, unlike `</s>`, shows in the text: a real model's EOS tokens are special. Where the
    grammar may not end (inside a JSON string), llguidance reads it as text, and the request goes on."""
    from transformers import AutoTokenizer

    eos = json.loads((tiny_model / "generation_config.json").read_text())["eos_token_id"][1]
    return AutoTokenizer.from_pretrained(tiny_model).decode([eos])


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range. A launcher binds its ports seconds after it is
    given them (its shards start first); a port from the ephemeral range could meanwhile become the local end of
    some outgoing connection (it did: the router failed with "address already in use"), one below it cannot.
    Each port is given once per session."""
    low = _ephemeral_low()
    if low - PORTS_FROM < 1000:  # an unusual ephemeral range: take one the kernel picks
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for port in random.Random().sample(range(PORTS_FROM, low), min(400, low - PORTS_FROM)):
        if port in _GIVEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    raise RuntimeError(f"no free port in {PORTS_FROM}-{low}")


PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    model_dir: Path
    grpc: str  # host:port of the gRPC front door

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def children(self) -> list:
        import psutil

        return psutil.Process(self.process.pid).children(recursive=False)

    def shard_pids(self) -> list[int]:
        return [c.pid for c in self.children() if "conveyor.shard.main" in " ".join(c.cmdline())]

    def socket_dir(self) -> str:
        """The directory of the shards' sockets, from the launcher's command line for its shard."""
        shard = next(c for c in self.children() if "conveyor.shard.main" in " ".join(c.cmdline()))
        argv = shard.cmdline()
        return os.path.dirname(argv[argv.index("--shard-uds-path") + 1])

    def shard_pid(self, rank: int) -> int:
        import psutil

        (pid,) = [pid for pid in self.shard_pids() if psutil.Process(pid).environ().get("RANK") == str(rank)]
        return pid

    def health(self) -> int:
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.HTTPError:
            return 0

    def info(self) -> dict:
        return httpx.get(f"{self.url}/info", timeout=10.0).json()

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """A counter or gauge without labels, from /metrics (`headers`: a --metrics-key's Authorization)."""
        for line in httpx.get(f"{self.url}/metrics", headers=headers, timeout=10.0).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def raw_connection(self, timeout: float) -> socket.socket:
        """A bare TCP connection to the router, for bytes no HTTP client would send."""
        host, port = self.url.removeprefix("http://").split(":")
        return socket.create_connection((host, int(port)), timeout=timeout)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=90)

    @contextmanager
    def shards_paused(self) -> Iterator[None]:
        """SIGSTOPs every shard: the step in flight waits (far within its deadline) and nothing running finishes,
        while the router still queues, lists and cancels. What a test sets up meanwhile is decided by the queue,
        not by how fast this machine generates."""
        import psutil

        shards = [psutil.Process(pid) for pid in self.shard_pids()]
        for shard in shards:
            shard.suspend()
        try:
            yield
        finally:
            for shard in shards:
                shard.resume()


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    chunks = []
    while chunk := connection.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read_answer_until_closed(connection: socket.socket) -> bytes:
    """For a request whose body the client will not send (refused, or slower than its length): one whole answer
    (its head, and its Content-Length bytes), then the client ends its side as a client told no would, and what
    follows until the server closes. Left open, the server would read for the body it did not take during aiohttp's
    lingering time (10 s) before closing. An interim `100 Continue` counts as an answer, and is in what is returned."""
    answer = b""
    while (end := answer.find(b"\r\n\r\n")) < 0 or len(answer) < end + 4 + _content_length(answer):
        chunk = connection.recv(65536)
        if not chunk:
            return answer  # closed by the server: all there is
        answer += chunk
    connection.shutdown(socket.SHUT_WR)
    return answer + read_until_closed(connection)


def _content_length(answer: bytes) -> int:
    """The Content-Length of an answer's head (the last head's, after any interim `100 Continue`); 0 if none."""
    lengths = re.findall(rb"(?im)^content-length: *(\d+)\r$", answer)
    return int(lengths[-1]) if lengths else 0


class StreamWatcher:
    """Reads one stream on a thread, recording each event, so a test can wait for 'n tokens arrived'. `path` and
    `headers` pick the route and the key (OpenAI's closing `[DONE]` is recorded as that string)."""

    def __init__(
        self, server: Server, body: dict, path: str = "/generate_stream", headers: dict[str, str] | None = None
    ) -> None:
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.server, self.body, self.path, self.request_headers = server, body, path, headers or {}
        self.headers: httpx.Headers | None = None  # the response's, once it opened
        self.hang_up = threading.Event()  # set to make the client disconnect at its next event
        self.finished = False
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        with (
            self.server.client() as client,
            client.stream("POST", self.path, json=self.body, headers=self.request_headers) as r,
        ):
            assert r.status_code == 200, r.read()
            self.headers = r.headers
            for event in sseclient.SSEClient(r.iter_bytes()).events():
                with self.lock:
                    self.events.append(event.data if event.data == "[DONE]" else json.loads(event.data))
                if self.hang_up.is_set():
                    return
        self.finished = True

    def start(self) -> StreamWatcher:
        """Runs the stream on a thread of its own; `last` waits for it and raises what it raised."""

        def read() -> None:
            try:
                self.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the test by `last`
                self.error = exc

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()
        return self

    def last(self, timeout: float = 300) -> dict:
        """The stream's last event, once it ended (a stream started with `start`)."""
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error
        return self.events[-1]

    def received(self, n: int) -> bool:
        with self.lock:
            return len(self.events) >= n

    def token_ids(self) -> list[int]:
        with self.lock:
            return [e["token"]["id"] for e in self.events if "token" in e]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_server(
    model_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    python: str = sys.executable,
    cwd: Path | None = None,
) -> Server:
    """A deployment through the real launcher; `extra` are launcher flags, `env` extra environment, `log` a file
    for every process's log lines (default: the test's stderr), `python` the interpreter of another install."""
    port, grpc_port = free_port(), free_port()
    if TEST_DEVICE == "cuda" and "--max-batch-total-tokens" not in extra:
        extra = (*extra, "--max-batch-total-tokens", GPU_POOL_TOKENS)
    env = {**os.environ, "CONVEYOR_LOG_LEVEL": os.environ.get("CONVEYOR_LOG_LEVEL", "WARNING"), **(env or {})}
    if "HF_ENDPOINT" not in env:  # no Hub but a test's stand-in: a Hub id (an adapter's, say) fails offline at once
        env["HF_HUB_OFFLINE"] = "1"
    process = subprocess.Popen(
        [
            python,
            "-m",
            "conveyor.launcher.main",
            "--model-id",
            str(model_dir),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            *extra,
        ],
        env=env,
        stderr=None if log is None else log.open("ab"),
        cwd=cwd,
    )
    _LAUNCHERS.append(process)
    server = Server(f"http://127.0.0.1:{port}", process, model_dir, f"127.0.0.1:{grpc_port}")
    wait_until_serving(server)
    return server


def wait_until_serving(server: Server, what: str = "the server to answer /health") -> None:
    """Until the launcher's router answers /health; a launcher that exits first fails at once, and one that misses
    the deadline is stopped."""

    def ready() -> bool:
        if server.process.poll() is not None:
            raise RuntimeError(f"launcher exited with {server.process.returncode} while starting")
        return _healthy(server.url)

    try:
        wait_for(ready, 180, what)
    except BaseException:
        server.stop()
        raise


# How many starts overlap. A start is mostly imports, one process at a time (the shards, then the router), so a few
# overlap well: on 2 cores, three at once took clearly less time than one after another. Many more at once only
# share the same two cores, and each start's deadline (180 s) then runs out on a slow machine: CI once started the
# oracle module's 19 deployments together and three of them missed it.
STARTS_AT_ONCE = 3


def start_servers(*starts: Callable[[], Server]) -> list[Server]:
    """Runs several starts (each a call of start_server), STARTS_AT_ONCE at a time; each start's deadline counts
    from its own beginning. If one fails, those that came up are stopped and its error is raised."""
    with ThreadPoolExecutor(min(len(starts), STARTS_AT_ONCE)) as pool:
        futures = [pool.submit(start) for start in starts]
    errors = [f.exception() for f in futures if f.exception() is not None]
    servers = [f.result() for f in futures if f.exception() is None]
    if errors:
        stop_servers(servers)
        raise errors[0]
    return servers


def stop_servers(servers: Iterable[Server]) -> list[int]:
    """Stops several deployments at once (each drains and stops its children in order); their exit codes."""
    servers = list(servers)
    for server in servers:
        if server.process.poll() is None:
            server.process.send_signal(signal.SIGTERM)
    return [server.process.wait(timeout=90) for server in servers]


class Deployments:
    """Named deployments that tests share. The first `get` starts all of `wanted` at once (start_servers); a later
    `get` starts one again if a test ended it (a SIGTERM, a crash past --max-restarts). `stop` stops those still
    running and returns their exit codes; a test that ended one checked its code itself."""

    def __init__(self, starts: dict[str, Callable[[], Server]], wanted: Iterable[str] | None = None) -> None:
        self.starts = starts
        self.wanted = list(starts if wanted is None else wanted)
        self.servers: dict[str, Server] = {}
        self.first = True

    def get(self, name: str) -> Server:
        server = self.servers.get(name)
        if server is None or server.process.poll() is not None:
            names = [name] + [n for n in self.wanted if n != name and n not in self.servers] if self.first else [name]
            self.first = False
            self.servers.update(zip(names, start_servers(*(self.starts[n] for n in names))))
        return self.servers[name]

    def stop(self) -> list[int]:
        return stop_servers(s for s in self.servers.values() if s.process.poll() is None)


def used(request: pytest.FixtureRequest, names: Iterable[str], module: bool = False) -> list[str]:
    """Those of these fixtures that a test selected to run uses (of the requesting module only, if `module`)."""
    items = [i for i in request.session.items if not module or getattr(i, "module", None) is request.module]
    return [name for name in names if any(name in item.fixturenames for item in items)]


@pytest.fixture(scope="session")
def session_deployments(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Deployments]:
    """The deployments of `server` and `small_kv`: those the selected tests use start together, at the first use
    of either."""
    starts = {
        "server": lambda: start_server(tiny_model, "--max-total-tokens", "512", "--max-batch-prefill-tokens", "2048"),
        "small_kv": lambda: start_server(
            tiny_model,
            "--master-port",
            str(free_port()),
            "--max-batch-total-tokens",
            "512",
            "--max-total-tokens",
            "256",
        ),
    }
    deployments = Deployments(starts, used(request, starts))
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="session")
def server(session_deployments: Deployments) -> Server:
    """One deployment on the tiny model shared by the tests that leave it healthy."""
    return session_deployments.get("server")


@pytest.fixture(scope="session")
def small_kv(session_deployments: Deployments) -> Server:
    """A KV pool of 32 blocks of 16 tokens: a few long requests outgrow it, so the scheduler has to preempt. One
    deployment for tests/e2e/test_kv_blocks.py, tests/e2e/test_scheduling.py and tests/faults/test_soak.py (a start
    takes many seconds on 2 cores): they read counters as differences, and the soak's SIGKILLed shard comes back
    with the same pool (its size is given, not measured)."""
    server = session_deployments.get("small_kv")
    assert server.info()["kv_blocks_total"] == 32
    return server


def chat_model(source: Path, out_dir: Path, template: str) -> Path:
    """A copy of the model in `source` with `template` as its chat template, and one EOS id: the tiny model's
    second (an ordinary token) would show in the text where a grammar lets the output end."""
    shutil.copytree(source, out_dir)
    generation_path = out_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text())
    eos = generation["eos_token_id"]
    generation["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
    generation_path.write_text(json.dumps(generation, indent=2))
    tokenizer_path = out_dir / "tokenizer_config.json"
    tokenizer = json.loads(tokenizer_path.read_text())
    tokenizer["chat_template"] = template
    tokenizer_path.write_text(json.dumps(tokenizer, indent=2))
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    return out_dir


# The deployments of the test models shaped like each family (tests/chat_templates.py), by fixture name.
CHAT_DEPLOYMENTS = {
    "qwen3_chat_server": "qwen3",
    "r1_chat_server": "r1",
    "llama3_chat_server": "llama3",
    "mistral_chat_server": "mistral",
    "phi4_chat_server": "phi4_mini",
}


@pytest.fixture(scope="session")
def chat_deployments(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployments]:
    """The tiny model with each family's chat template, served (tests/e2e/test_chat_families.py and
    test_reasoning_serving.py): those the selected tests use start together, at the first use of any."""
    root = tmp_path_factory.mktemp("chat_models")
    ports = {name: free_port() for name in CHAT_DEPLOYMENTS}

    def start(name: str) -> Server:
        family = CHAT_DEPLOYMENTS[name]
        model = chat_model(tiny_model, root / family, CHAT_TEMPLATES[family])
        flags = ["--master-port", str(ports[name]), "--max-total-tokens", "1024", "--max-batch-total-tokens", "8192"]
        return start_server(model, *flags)

    starts = {name: (lambda name=name: start(name)) for name in CHAT_DEPLOYMENTS}
    deployments = Deployments(starts, used(request, starts))
    yield deployments
    codes = deployments.stop()
    assert codes == [0] * len(codes)


@pytest.fixture(scope="session")
def qwen3_chat_server(chat_deployments: Deployments) -> Server:
    """Qwen3's template: Hermes tool calls, a <think> block the model opens, `enable_thinking`."""
    return chat_deployments.get("qwen3_chat_server")


@pytest.fixture(scope="session")
def r1_chat_server(chat_deployments: Deployments) -> Server:
    """DeepSeek-R1's template: the generation prompt opens the <think> block."""
    return chat_deployments.get("r1_chat_server")


@pytest.fixture(scope="session")
def llama3_chat_server(chat_deployments: Deployments) -> Server:
    """Llama 3.1's template: JSON tool calls with "parameters"."""
    return chat_deployments.get("llama3_chat_server")


@pytest.fixture(scope="session")
def mistral_chat_server(chat_deployments: Deployments) -> Server:
    """Mistral's template: [TOOL_CALLS] and a JSON list; call ids of 9 letters and digits."""
    return chat_deployments.get("mistral_chat_server")


@pytest.fixture(scope="session")
def phi4_chat_server(chat_deployments: Deployments) -> Server:
    """Phi-4-mini's template shape: tools between <|tool|> and <|/tool|>, calls after <|tool_call|>."""
    return chat_deployments.get("phi4_chat_server")


@dataclass
class Tls:
    cert: Path
    key: Path

    @property
    def flags(self) -> list[str]:
        # One self-signed certificate is the CA, the shard's server certificate and the router's client one.
        return ["--shard-tls-cert", str(self.cert), "--shard-tls-key", str(self.key), "--shard-tls-ca", str(self.cert)]

    def credentials(self, client_certificate: bool = True) -> grpc.ChannelCredentials:
        cert = self.cert.read_bytes()
        if not client_certificate:
            return grpc.ssl_channel_credentials(root_certificates=cert)
        return grpc.ssl_channel_credentials(cert, self.key.read_bytes(), cert)


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """One self-signed certificate for shards on TCP with mutual TLS (tests/e2e/test_shard_tcp.py, test_replicas.py)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=conveyor-test"]
        + ["-keyout", str(key), "-out", str(cert)]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        + ["-addext", "extendedKeyUsage=serverAuth,clientAuth"],
        check=True,
        capture_output=True,
    )
    return Tls(cert, key)
