"""A deployment whose KV pool holds exactly one longest request (64 tokens, 4 blocks of 16).

- A request whose KV could never fit the pool, even alone, is refused with 422 at validation: it never waits in
  the queue (where the planner would preempt it for ever). `--max-total-tokens` is what validation enforces, and
  the router refuses to start when the pool measured at warmup is smaller than that (tests/e2e/test_kv_blocks.py),
  so "fits the limits" means "fits an empty pool".
- A request that fits alone but not beside others waits for room (or is preempted and recomputed); it is never
  failed for lack of KV that a later moment gives.
- The shard, spoken to directly over its socket with unknown batch ids and malformed requests, answers each
  with a clean INVALID_ARGUMENT and goes on serving the router's batch.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import Server, start_server, wait_for

from conveyor.v1 import shard_pb2 as spb
from conveyor.v1 import shard_pb2_grpc as spb_grpc

POOL = 64  # tokens: --max-batch-total-tokens, and --max-total-tokens
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sock")


@pytest.fixture(scope="module")
def tiny_pool(tiny_model: Path, socket_dir: Path) -> Iterator[Server]:
    server = start_server(
        tiny_model,
        "--max-total-tokens",
        str(POOL),
        "--max-batch-total-tokens",
        str(POOL),
        "--shard-uds-path",
        str(socket_dir / "shard"),
    )
    yield server
    assert server.stop() == 0


def info(server: Server) -> dict:
    return httpx.get(f"{server.url}/info", timeout=10).json()


def prompt_tokens(server: Server, prompt: str = PROMPT) -> int:
    return len(httpx.post(f"{server.url}/tokenize", json={"inputs": prompt}, timeout=10).json())


def preemptions(server: Server) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(
        next(line for line in metrics.splitlines() if line.startswith("conveyor_preemptions_total ")).split()[1]
    )


def all_blocks_free(server: Server) -> bool:
    pool = info(server)
    return pool["kv_blocks_free"] == pool["kv_blocks_total"]


def test_the_limits_are_the_pool(tiny_pool: Server) -> None:
    pool = info(tiny_pool)
    assert pool["max_batch_total_tokens"] == POOL and pool["max_total_tokens"] == POOL
    assert pool["kv_blocks_total"] * pool["block_size"] == POOL


def test_a_request_that_can_never_fit_is_422_on_every_route(tiny_pool: Server) -> None:
    n = prompt_tokens(tiny_pool)
    too_many = POOL - n + 1  # one token more than an empty pool holds
    refused = [
        ("/generate", {"inputs": PROMPT, "parameters": {"max_new_tokens": too_many}}),
        ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": too_many}}),
        ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": too_many}, "stream": True}),
        ("/generate", {"inputs": "x " * 200, "parameters": {"max_new_tokens": 1}}),  # the prompt alone
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": too_many}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 100}], "max_tokens": 1}),
    ]
    with tiny_pool.client() as client:
        for route, body in refused:
            response = client.post(route, json=body)
            assert response.status_code == 422, (route, response.text)
            assert response.json()["error_type"] == "validation"
    assert "conveyor_queue_size 0.0" in httpx.get(f"{tiny_pool.url}/metrics", timeout=10).text
    assert all_blocks_free(tiny_pool)


def test_a_request_exactly_the_pool_size_completes(tiny_pool: Server) -> None:
    n = prompt_tokens(tiny_pool)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": POOL - n, "ignore_eos": True, "details": True}}
    response = httpx.post(f"{tiny_pool.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] == POOL - n
    wait_for(lambda: all_blocks_free(tiny_pool), 30, "every block to be free again")


def test_requests_that_fit_alone_but_not_together_wait_and_all_complete(tiny_pool: Server) -> None:
    """Four requests that each need the whole pool, at once: they take turns (the newest is preempted and
    recomputed), each gets every token it asked for, and greedy decoding gives them the same tokens."""
    n = prompt_tokens(tiny_pool)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": POOL - n, "ignore_eos": True, "details": True}}
    preempted = preemptions(tiny_pool)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: httpx.post(f"{tiny_pool.url}/generate", json=body, timeout=300), range(4)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    tokens = [[t["id"] for t in r.json()["details"]["tokens"]] for r in responses]
    assert all(len(t) == POOL - n for t in tokens)
    assert all(t == tokens[0] for t in tokens)
    assert preemptions(tiny_pool) > preempted  # they did not fit together
    wait_for(lambda: all_blocks_free(tiny_pool), 30, "every block to be free again")


# --- the shard, spoken to directly ------------------------------------------------------------------------


def _bad_requests(block_size: int) -> list[tuple[str, object]]:
    """RPCs a buggy router could send: unknown batches, and requests the shard cannot run."""

    def request(**fields: object) -> spb.Request:
        base = {
            "id": 1 << 40,
            "input_ids": [1, 2, 3],
            "parameters": spb.SamplingParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0),
            "stopping_parameters": spb.StoppingParameters(max_new_tokens=2),
            "blocks": [0],
        }
        return spb.Request(**{**base, **fields})

    def prefill(*requests: spb.Request, **fields: object) -> spb.PrefillRequest:
        return spb.PrefillRequest(batch=spb.Batch(id=1 << 40, requests=list(requests), size=len(requests)), **fields)

    unknown = spb.CachedBatch(id=(1 << 40) + 1, request_ids=[1], size=1)
    return [
        ("Decode", spb.DecodeRequest(batches=[unknown])),
        ("Decode", spb.DecodeRequest()),
        ("FilterBatch", spb.FilterBatchRequest(batch_id=unknown.id, request_ids=[1])),
        ("Prefill", prefill()),
        ("Prefill", prefill(request(), cached_batch=unknown)),
        ("Prefill", prefill(request(input_ids=[]))),
        ("Prefill", prefill(request(input_ids=[1 << 31]))),
        ("Prefill", prefill(request(blocks=[]))),
        ("Prefill", prefill(request(blocks=[1 << 20]))),
        ("Prefill", prefill(request(input_ids=[1] * (block_size + 1), blocks=[0]))),
        ("Prefill", prefill(request(resumed_tokens=10))),
        ("Warmup", spb.WarmupRequest()),
    ]


def _stream(server: Server, body: dict, started: threading.Event) -> list[dict]:
    """The events of one stream; `started` is set at the first token."""
    events = []
    with server.client() as client, client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                started.set()
    return events


def test_a_shard_answers_bad_requests_cleanly_and_serves_on(tiny_pool: Server, socket_dir: Path) -> None:
    """While the router streams a request, the shard gets RPCs naming batches it does not hold and requests it
    cannot run: each one fails alone with INVALID_ARGUMENT, and the router's stream completes unharmed."""
    n = prompt_tokens(tiny_pool)
    greedy = {"inputs": PROMPT, "parameters": {"max_new_tokens": POOL - n, "ignore_eos": True}}
    expected = httpx.post(f"{tiny_pool.url}/generate", json=greedy, timeout=120).json()["generated_text"]

    channel = grpc.insecure_channel(f"unix://{socket_dir}/shard-0")
    shard = spb_grpc.ShardStub(channel)
    block_size = shard.Info(spb.InfoRequest(), timeout=10).block_size
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, tiny_pool, greedy, started)
        wait_for(lambda: started.is_set() or running.done(), 120, "the stream's first token")
        codes = []
        for method, message in _bad_requests(block_size):
            with pytest.raises(grpc.RpcError) as failure:
                getattr(shard, method)(message, timeout=30)
            codes.append((method, failure.value.code(), failure.value.details()))
        events = running.result()
    channel.close()
    assert all(code is grpc.StatusCode.INVALID_ARGUMENT for _, code, _ in codes), codes
    assert len(events) == POOL - n and events[-1]["generated_text"] == expected
    assert httpx.get(f"{tiny_pool.url}/health", timeout=10).status_code == 200
    wait_for(lambda: all_blocks_free(tiny_pool), 30, "every block to be free again")
