"""LoRA adapters through the real processes: mixed batches exact against transformers with each adapter merged,
selection on every front door, live loading by an admin, per-adapter prefix caching, replay after a crash.

Two deployments of the tiny model serve conftest's two random PEFT adapters from the start: one shard with API
keys (`ops`, an admin; `tenant`, not) and two shards. The reference for a request under an adapter is
transformers' `generate()` on the base model with that adapter merged (`merge_and_unload`); every adapter is also
checked to change the output, so that a server ignoring adapters cannot pass.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import sseclient
from conftest import (
    ORACLE_PROMPTS,
    Server,
    free_port,
    greedy_reference,
    one_torch_thread,
    start_server,
    start_servers,
    wait_for,
)

from conveyor.client import Client

KEYS = {"ops": {"key": "sk-ops-0123456789", "admin": True}, "tenant": {"key": "sk-tenant-0123456789"}}
PROMPTS = ORACLE_PROMPTS[:6]
ADAPTER_READ_TIMEOUT = 10  # seconds a live load may read an adapter's files on the keyed server
LONG_PROMPT = "def checksum(data):\n    total = 0\n    for byte in data:\n        total += byte\n" * 3


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]['key']}"}


@functools.cache
def merged_reference(model_dir: Path, adapter_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate()` on the base model with the adapter merged into its weights."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode(), one_torch_thread():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def reference(model_dir: Path, adapters: dict[str, Path], adapter: str | None, prompt: str, n: int) -> list[int]:
    if adapter is None:
        return greedy_reference(model_dir, prompt, n)
    return merged_reference(model_dir, adapters[adapter], prompt, n)


@pytest.fixture(scope="module")
def servers(
    tiny_model: Path, lora_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    keys = tmp_path_factory.mktemp("lora-keys") / "keys.json"
    keys.write_text(json.dumps({"keys": [{"name": name, **fields} for name, fields in KEYS.items()]}))
    flag = ",".join(f"{name}={path}" for name, path in lora_adapters.items())
    common = ("--lora-adapters", flag, "--max-total-tokens", "512")
    one, two = start_servers(
        functools.partial(
            start_server,
            tiny_model,
            *common,
            "--max-loras",
            "3",
            "--api-keys-file",
            str(keys),
            env={"CONVEYOR_ADAPTER_READ_TIMEOUT": str(ADAPTER_READ_TIMEOUT)},
        ),
        functools.partial(start_server, tiny_model, *common, "--num-shard", "2", "--master-port", str(free_port())),
    )
    yield one, two
    assert [one.stop(), two.stop()] == [0, 0]


@pytest.fixture(scope="module")
def keyed(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module", params=["1-shard", "2-shards"])
def deployment(request: pytest.FixtureRequest, servers: tuple[Server, Server]) -> Server:
    return servers[0] if request.param == "1-shard" else servers[1]


def generate(server: Server, prompt: str, n: int, adapter: str | None, headers: dict | None = None) -> httpx.Response:
    parameters: dict = {"max_new_tokens": n, "details": True}
    if adapter is not None:
        parameters["adapter_id"] = adapter
    body = {"inputs": prompt, "parameters": parameters}
    return httpx.post(f"{server.url}/generate", json=body, headers=headers or {}, timeout=300)


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


class Stream:
    """One streamed request on its own thread, under an adapter (None: the base model)."""

    def __init__(self, prompt: str, n: int, adapter: str | None) -> None:
        self.prompt, self.n, self.adapter = prompt, n, adapter
        self.ids: list[int] = []
        self.done = threading.Event()

    def run(self, url: str, headers: dict[str, str], start: threading.Event) -> None:
        start.wait(120)
        parameters: dict = {"max_new_tokens": self.n}
        if self.adapter is not None:
            parameters["adapter_id"] = self.adapter
        body = {"inputs": self.prompt, "parameters": parameters}
        try:
            with (
                httpx.Client(timeout=300) as client,
                client.stream("POST", f"{url}/generate_stream", json=body, headers=headers) as response,
            ):
                assert response.status_code == 200, response.read()
                for event in sseclient.SSEClient(response.iter_bytes()).events():
                    payload = json.loads(event.data)
                    assert "error" not in payload, payload
                    self.ids.append(payload["token"]["id"])
        finally:
            self.done.set()


def test_a_staggered_batch_mixing_adapters_matches_transformers_merged(
    deployment: Server, tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    """Base, adapter A and adapter B requests join one running batch at staggered moments; each yields exactly
    the tokens of generate() with its adapter merged, and each adapter changes what the base model says."""
    names = [None, *sorted(lora_adapters)]
    headers = auth("ops")  # the 2-shard deployment is open: it takes any caller as anonymous
    streams = [Stream(p, n, names[k % len(names)]) for k, (p, n) in enumerate(PROMPTS)]
    starts = [threading.Event() for _ in streams]
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(s.run, deployment.url, headers, e) for s, e in zip(streams, starts)]
        starts[0].set()
        for k in range(1, len(streams)):
            previous = streams[k - 1]
            wait_for(lambda p=previous: len(p.ids) >= 2 or p.done.is_set(), 120, f"stream {k - 1} to start")
            starts[k].set()
        for future in futures:
            future.result()
    for s in streams:
        assert s.ids == reference(tiny_model, lora_adapters, s.adapter, s.prompt, s.n), (s.adapter, s.prompt)
    for name in sorted(lora_adapters):
        changed = [
            reference(tiny_model, lora_adapters, name, p, n) != greedy_reference(tiny_model, p, n) for p, n in PROMPTS
        ]
        assert any(changed), f"adapter {name} changes no output: the test could not tell it from the base model"


def test_every_front_door_selects_the_adapter(keyed: Server, tiny_model: Path, lora_adapters: dict[str, Path]):
    name = sorted(lora_adapters)[0]
    prompt, n = PROMPTS[1]
    expected = merged_reference(tiny_model, lora_adapters[name], prompt, n)
    tgi = generate(keyed, prompt, n, name, auth("tenant"))
    assert token_ids(tgi) == expected
    completion = httpx.post(
        f"{keyed.url}/v1/completions",
        json={"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1},
        headers=auth("tenant"),
        timeout=300,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == tgi.json()["generated_text"]  # the same tokens' text
    with Client(keyed.grpc, api_key=KEYS["tenant"]["key"]) as client:
        answer = client.generate(prompt, max_new_tokens=n, details=True, adapter_id=name)
    assert [t.id for t in answer.details.tokens] == expected


def test_an_unknown_adapter_is_a_404_naming_the_served_ones(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    response = generate(keyed, "x", 2, "no-such-adapter", auth("tenant"))
    assert response.status_code == 404, response.text
    body = response.json()
    assert body["error_type"] == "not_found"
    assert all(name in body["error"] for name in lora_adapters)
    with Client(keyed.grpc, api_key=KEYS["tenant"]["key"]) as client:
        with pytest.raises(Exception, match="no-such-adapter"):
            client.generate("x", max_new_tokens=2, adapter_id="no-such-adapter")


def test_models_and_info_list_the_adapters(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    models = httpx.get(f"{keyed.url}/v1/models", headers=auth("tenant"), timeout=30).json()["data"]
    base = models[0]["id"]
    listed = {m["id"]: m for m in models[1:]}
    assert set(listed) >= set(lora_adapters)
    assert all(listed[name]["parent"] == base for name in lora_adapters)
    info = httpx.get(f"{keyed.url}/info", headers=auth("tenant"), timeout=30).json()
    adapters = {a["name"]: a for a in info["lora_adapters"]}
    assert set(adapters) >= set(lora_adapters) and info["max_loras"] == 3
    assert all(adapters[name]["weight_bytes"] > 0 and adapters[name]["rank"] in (8, 16) for name in lora_adapters)


def load(server: Server, name: str, path: Path | str, who: str = "ops") -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=auth(who), timeout=300)


def unload(server: Server, name: str, who: str = "ops") -> httpx.Response:
    body = {"lora_name": name}
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, headers=auth(who), timeout=300)


def test_load_use_unload_and_reload_live(keyed: Server, tiny_model: Path, lora_adapters: dict[str, Path]) -> None:
    source = lora_adapters[sorted(lora_adapters)[1]]
    prompt, n = PROMPTS[2]
    expected = merged_reference(tiny_model, source, prompt, n)
    refused = load(keyed, "live", source, who="tenant")
    assert refused.status_code == 403 and refused.json()["error_type"] == "forbidden", refused.text
    assert load(keyed, "live", source).status_code == 200
    assert token_ids(generate(keyed, prompt, n, "live", auth("tenant"))) == expected
    assert load(keyed, "live", source).status_code == 409  # the name is taken
    assert unload(keyed, "live", who="tenant").status_code == 403
    assert unload(keyed, "live").status_code == 200
    assert generate(keyed, prompt, n, "live", auth("tenant")).status_code == 404
    assert unload(keyed, "live").status_code == 404
    assert load(keyed, "live", source).status_code == 200
    assert token_ids(generate(keyed, prompt, n, "live", auth("tenant"))) == expected
    assert unload(keyed, "live").status_code == 200


def test_past_max_loras_a_load_is_refused(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    source = next(iter(lora_adapters.values()))
    assert load(keyed, "third", source).status_code == 200  # 2 from the start + this one = --max-loras 3
    refused = load(keyed, "fourth", source)
    assert refused.status_code == 409 and "--max-loras" in refused.json()["error"], refused.text
    assert unload(keyed, "third").status_code == 200


def test_a_broken_adapter_is_refused_and_the_server_serves_on(
    keyed: Server, tiny_model: Path, lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    good = next(iter(lora_adapters.values()))
    (broken / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    refused = load(keyed, "broken", broken)
    assert refused.status_code == 400, refused.text
    assert "adapter_model.safetensors" in refused.json()["error"]
    missing = load(keyed, "nothing", tmp_path / "nowhere")
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"], missing.text
    prompt, n = PROMPTS[0]
    assert token_ids(generate(keyed, prompt, n, None, auth("tenant"))) == greedy_reference(tiny_model, prompt, n)
    models = httpx.get(f"{keyed.url}/v1/models", headers=auth("tenant"), timeout=30).json()["data"]
    assert not {"broken", "nothing"} & {m["id"] for m in models}


def blocked_opening_a_fifo(pid: int) -> bool:
    """Some thread of the process waits in the kernel for a FIFO's writer: its wait channel says so, or, where the
    kernel shows no wait channel, it sits in openat (x86-64's 257; a passing open seen there only starts the check
    early, and the load, bound to take ADAPTER_READ_TIMEOUT, is still pending after the request either way)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "wchan").read_text() == "wait_for_partner" or (task / "syscall").read_text().startswith("257 "):
                return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def test_an_adapter_whose_file_blocks_stalls_its_load_alone(
    keyed: Server, tiny_model: Path, lora_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The shard reads an adapter's files off the thread that runs the steps, within a time bound: while a file
    blocks on read (a FIFO with no writer here, a hung network filesystem in life), another key is served, and the
    load is refused when the bound passes (before, generation stopped for as long as the read blocked)."""
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    good = next(iter(lora_adapters.values()))
    (stuck / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    fifo = stuck / "adapter_model.safetensors"
    os.mkfifo(fifo)
    with ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load, keyed, "stuck", stuck)
        (shard,) = keyed.shard_pids()
        wait_for(lambda: blocked_opening_a_fifo(shard), 60, "the shard to block opening the adapter's file")
        prompt, n = PROMPTS[1]
        served = generate(keyed, prompt, n, None, auth("tenant"))
        assert token_ids(served) == greedy_reference(tiny_model, prompt, n)
        assert not loading.done()  # it was served while the read still blocked
        refused = loading.result(timeout=300)
    assert refused.status_code == 400, refused.text
    assert f"not read within {ADAPTER_READ_TIMEOUT} s" in refused.json()["error"], refused.text
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked thread's open returns; it reads nothing
    os.close(writer)
    models = httpx.get(f"{keyed.url}/v1/models", headers=auth("tenant"), timeout=30).json()["data"]
    assert "stuck" not in {m["id"] for m in models}


def test_an_adapter_in_use_cannot_be_unloaded(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    source = next(iter(lora_adapters.values()))
    assert load(keyed, "busy", source).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        with keyed.shards_paused():
            running = pool.submit(generate, keyed, "def f():", 8, "busy", auth("tenant"))
            wait_for(lambda: _requests(keyed), 60, "the request to be in flight")
            refused = unload(keyed, "busy")
        assert running.result().status_code == 200
    assert refused.status_code == 409 and "busy" in refused.json()["error"], refused.text
    assert unload(keyed, "busy").status_code == 200


def _requests(server: Server) -> list[dict]:
    return httpx.get(f"{server.url}/v1/requests", headers=auth("ops"), timeout=30).json()["data"]


def test_prefix_cache_is_not_shared_between_adapters(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    a, b = sorted(lora_adapters)

    def hits_of(adapter: str | None) -> float:
        before = keyed.metric("conveyor_prefix_cache_hits_total", headers=auth("ops"))
        assert generate(keyed, LONG_PROMPT, 2, adapter, auth("tenant")).status_code == 200
        return keyed.metric("conveyor_prefix_cache_hits_total", headers=auth("ops")) - before

    hits_of(a)
    assert hits_of(a) > 0  # the same prompt under the same adapter reuses its blocks
    assert hits_of(b) == 0
    assert hits_of(None) == 0


def test_metrics_count_requests_and_tokens_per_adapter(keyed: Server, lora_adapters: dict[str, Path]) -> None:
    name = sorted(lora_adapters)[0]
    labels = {"adapter": name}
    requests = keyed.metric(_labelled("conveyor_adapter_requests_total", labels), headers=auth("ops"))
    tokens = keyed.metric(_labelled("conveyor_adapter_generated_tokens_total", labels), headers=auth("ops"))
    assert len(token_ids(generate(keyed, "def g():", 5, name, auth("tenant")))) == 5
    assert keyed.metric(_labelled("conveyor_adapter_requests_total", labels), headers=auth("ops")) == requests + 1
    assert keyed.metric(_labelled("conveyor_adapter_generated_tokens_total", labels), headers=auth("ops")) == tokens + 5
    state = httpx.get(f"{keyed.url}/dashboard/state", headers=auth("ops"), timeout=30).json()
    assert state["adapters"][name]["requests"] >= 1 and state["adapters"][name]["tokens"] >= 5


def _labelled(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def test_a_crash_replays_the_request_with_its_live_adapter(
    keyed: Server, tiny_model: Path, lora_adapters: dict[str, Path]
) -> None:
    """The shard group is SIGKILLed while a request of a live-loaded adapter runs: the restarted group gets the
    adapter again before the request is replayed, which then yields exactly the merged model's tokens."""
    import os
    import signal

    source = lora_adapters[sorted(lora_adapters)[1]]
    assert load(keyed, "survivor", source).status_code == 200
    prompt, n = PROMPTS[3]
    stream = Stream(prompt, 60, "survivor")
    start = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream.run, keyed.url, auth("tenant"), start)
        start.set()
        wait_for(lambda: len(stream.ids) >= 3 or stream.done.is_set(), 120, "the stream to start")
        os.kill(keyed.shard_pid(0), signal.SIGKILL)
        running.result()
    assert stream.ids == merged_reference(tiny_model, source, prompt, 60)
    wait_for(lambda: keyed.health() == 200, 180, "the restarted shards to be healthy")
    assert token_ids(generate(keyed, prompt, 5, "survivor", auth("tenant"))) == stream.ids[:5]
    assert unload(keyed, "survivor").status_code == 200


def test_where_adapters_live_on_disk_is_shown_to_an_admin_key_only(
    servers: tuple[Server, Server], lora_adapters: dict[str, Path]
) -> None:
    """`/v1/models` and `/info` are open routes: without an admin key they name the adapters, not their folders (an
    adapter card has no `root`, an adapter in `/info` no `source`), on a keyed server and on an open one alike."""
    keyed, open_server = servers
    paths = [str(path) for path in lora_adapters.values()]
    callers = [(keyed, {}), (keyed, auth("tenant")), (keyed, {"Authorization": "Bearer not-a-key"}), (open_server, {})]
    for server, headers in callers:
        models = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30)
        info = httpx.get(f"{server.url}/info", headers=headers, timeout=30)
        assert models.status_code == 200 and info.status_code == 200
        assert not [path for path in paths if path in models.text or path in info.text], (models.text, info.text)
        cards = {m["id"]: m for m in models.json()["data"]}
        assert all(set(cards[name]) == {"id", "object", "created", "owned_by", "parent"} for name in lora_adapters)
        assert all("source" not in adapter for adapter in info.json()["lora_adapters"])
    cards = {m["id"]: m for m in httpx.get(f"{keyed.url}/v1/models", headers=auth("ops"), timeout=30).json()["data"]}
    info = httpx.get(f"{keyed.url}/info", headers=auth("ops"), timeout=30).json()
    sources = {adapter["name"]: adapter["source"] for adapter in info["lora_adapters"]}
    for name, path in lora_adapters.items():  # an admin key's answer keeps them
        assert cards[name]["root"] == sources[name] == str(path)
