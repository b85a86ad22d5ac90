"""The HTTP API through a live deployment: SSE format, finish reasons, seeded sampling, validation errors."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sseclient
from conftest import EosProbe, Server, greedy_reference, wait_for


def stream_events(server: Server, body: dict) -> list[dict]:
    with server.client() as client, client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(e.data) for e in sseclient.SSEClient(response.iter_bytes()).events()]


def generate(server: Server, body: dict) -> httpx.Response:
    with server.client() as client:
        return client.post("/generate", json=body)


def test_sse_events_have_tgi_shape(server: Server) -> None:
    # TGI's shape exactly: no drafts, whose counts would add Conveyor's own keys to the details.
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 5, "details": True, "speculate": 0}}
    events = stream_events(server, body)
    assert len(events) == 5
    for n, event in enumerate(events, start=1):
        assert set(event) == {"index", "token", "generated_text", "details"}
        assert event["index"] == n
        token = event["token"]
        assert set(token) == {"id", "text", "logprob", "special"}
        assert isinstance(token["id"], int) and isinstance(token["text"], str)
        assert token["logprob"] <= 0 and token["special"] is False
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert last["details"] == {
        "finish_reason": "length",
        "generated_tokens": 5,
        "seed": None,
        "input_length": last["details"]["input_length"],
    }
    assert last["details"]["input_length"] > 0


def test_generate_details(server: Server) -> None:
    r = generate(
        server,
        {"inputs": "def f():", "parameters": {"max_new_tokens": 4, "details": True, "decoder_input_details": True}},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 4
    assert body["generated_text"] == "".join(t["text"] for t in details["tokens"])
    prefill = details["prefill"]
    assert prefill[0]["logprob"] is None and all(p["logprob"] <= 0 for p in prefill[1:])
    assert [t["id"] for t in details["tokens"]] == greedy_reference(server.model_dir, "def f():", 4)


def test_without_details_only_the_text_comes_back(server: Server) -> None:
    body = generate(server, {"inputs": "x", "parameters": {"max_new_tokens": 2}}).json()
    assert set(body) == {"generated_text"}


def test_return_full_text_prepends_the_prompt(server: Server) -> None:
    body = generate(server, {"inputs": "x = ", "parameters": {"max_new_tokens": 3, "return_full_text": True}}).json()
    plain = generate(server, {"inputs": "x = ", "parameters": {"max_new_tokens": 3}}).json()
    assert body["generated_text"] == "x = " + plain["generated_text"]


def test_max_new_tokens_ends_with_length(server: Server) -> None:
    details = generate(server, {"inputs": "import", "parameters": {"max_new_tokens": 7, "details": True}}).json()
    assert details["details"]["finish_reason"] == "length"
    assert details["details"]["generated_tokens"] == 7


def test_eos_ends_with_eos_token(server: Server, eos_probe: EosProbe) -> None:
    events = stream_events(server, {"inputs": eos_probe.prompt, "parameters": {"max_new_tokens": 50, "details": True}})
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    assert len(events) == eos_probe.step
    assert [e["token"]["id"] for e in events] == greedy_reference(server.model_dir, eos_probe.prompt, 50)


def test_stop_sequence_ends_with_stop_sequence(server: Server) -> None:
    prompt = "class Queue:"
    reference = generate(server, {"inputs": prompt, "parameters": {"max_new_tokens": 12}}).json()["generated_text"]
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {reference!r}"
    events = stream_events(
        server, {"inputs": prompt, "parameters": {"max_new_tokens": 12, "stop": [stop], "details": True}}
    )
    last = events[-1]
    assert last["details"]["finish_reason"] == "stop_sequence"
    text = last["generated_text"]
    assert stop in text and reference.startswith(text)
    before_last = "".join(e["token"]["text"] for e in events[:-1])
    assert stop not in before_last  # it stopped at the token that completed the stop sequence
    assert len(events) < 12


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(server: Server) -> None:
    seeded = {
        "inputs": "def sample():",
        "parameters": {
            "max_new_tokens": 20,
            "do_sample": True,
            "temperature": 0.9,
            "top_k": 50,
            "seed": 1234,
            "details": True,
        },
    }
    alone = generate(server, seeded).json()
    assert alone["details"]["seed"] == 1234

    started = [threading.Event() for _ in range(6)]

    def busy(n: int) -> None:
        body = {"inputs": "while True:" * (n + 1), "parameters": {"max_new_tokens": 60}}
        with server.client() as client, client.stream("POST", "/generate_stream", json=body) as response:
            for _ in sseclient.SSEClient(response.iter_bytes()).events():
                started[n].set()

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(busy, n) for n in range(6)]
        wait_for(lambda: all(e.is_set() for e in started), 120, "the busy batch to start streaming")
        in_batch = generate(server, seeded).json()
        for f in futures:
            f.result()
    assert in_batch["generated_text"] == alone["generated_text"]
    assert [t["id"] for t in in_batch["details"]["tokens"]] == [t["id"] for t in alone["details"]["tokens"]]


def test_sampling_without_seed_reports_the_seed_it_used(server: Server) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 3, "temperature": 0.7, "details": True}}
    first = generate(server, body).json()
    seed = first["details"]["seed"]
    assert isinstance(seed, int)
    body["parameters"]["seed"] = seed
    assert generate(server, body).json()["generated_text"] == first["generated_text"]


def test_top_k_zero_is_off(server: Server) -> None:
    """vLLM's reading: no top-k at all, so a request that sets nothing else stays greedy."""
    body = {"inputs": "def f():", "parameters": {"max_new_tokens": 4, "top_k": 0, "details": True}}
    r = generate(server, body)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    assert details["seed"] is None
    assert [t["id"] for t in details["tokens"]] == greedy_reference(server.model_dir, "def f():", 4)


BAD_BODIES = [
    pytest.param({"inputs": ""}, id="empty-inputs"),
    pytest.param({"inputs": "word " * 600}, id="inputs-too-long"),
    pytest.param({"inputs": "x", "parameters": {"max_new_tokens": 600}}, id="input-plus-new-over-total"),
    pytest.param({"inputs": "x", "parameters": {"temperature": 0}}, id="temperature-zero"),
    pytest.param({"inputs": "x", "parameters": {"temperature": -1.0}}, id="temperature-negative"),
    pytest.param({"inputs": "x", "parameters": {"top_p": 0}}, id="top-p-zero"),
    pytest.param({"inputs": "x", "parameters": {"top_p": 1.5}}, id="top-p-over-one"),
    pytest.param({"inputs": "x", "parameters": {"top_k": -1}}, id="top-k-negative"),
    pytest.param({"inputs": "x", "parameters": {"typical_p": 2}}, id="typical-p-over-one"),
    pytest.param({"inputs": "x", "parameters": {"repetition_penalty": 0}}, id="repetition-penalty-zero"),
    pytest.param({"inputs": "x", "parameters": {"max_new_tokens": 0}}, id="max-new-tokens-zero"),
    pytest.param({"inputs": "x", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, id="too-many-stops"),
    pytest.param({"inputs": "x", "parameters": {"seed": -1}}, id="negative-seed"),
    pytest.param({"inputs": "x", "parameters": {"max_new_tokens": "ten"}}, id="wrong-type"),
    pytest.param({"inputs": 42}, id="inputs-not-a-string"),
    pytest.param({"parameters": {}}, id="inputs-missing"),
    pytest.param(["not", "an", "object"], id="not-an-object"),
    pytest.param({"inputs": "x", "parameters": {"no_such_parameter": 1}}, id="unknown-parameter"),
]


@pytest.mark.parametrize("body", BAD_BODIES)
@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_bad_input_is_a_422_with_a_json_error(server: Server, route: str, body: object) -> None:
    with server.client() as client:
        r = client.post(route, json=body)
    assert r.status_code == 422, r.text
    payload = r.json()
    assert payload["error_type"] == "validation" and payload["error"]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"null"])
def test_malformed_bodies_are_422(server: Server, raw: bytes) -> None:
    with server.client() as client:
        r = client.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation"


def test_decoder_input_details_is_refused_when_streaming(server: Server) -> None:
    with server.client() as client:
        r = client.post("/generate_stream", json={"inputs": "x", "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_info_and_health(server: Server) -> None:
    with server.client() as client:
        info = client.get("/info").json()
        health = client.get("/health")
    assert health.status_code == 200
    assert info["model_id"] == str(server.model_dir)
    assert info["model_dtype"] == "float32"
    assert info["max_total_tokens"] == 512 and info["max_input_tokens"] == 511
    assert info["version"] and info["engine"] == "paged"  # auto picks it for a Llama model
    assert info["kv_blocks_free"] == info["kv_blocks_total"] > 0 and info["block_size"] == 16
