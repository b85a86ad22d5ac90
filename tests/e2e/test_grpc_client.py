"""`conveyor.client` (sync and async) over the gRPC front door of a live deployment."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import jsonschema
import pytest
from conftest import Server, greedy_reference, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conveyor.client import AsyncClient, Client, ConnectionError, ValidationError


def test_generate_stream_tokenize_info(server: Server) -> None:
    with Client(server.grpc, timeout=60) as client:
        response = client.generate("def add(a, b):", max_new_tokens=6, decoder_input_details=True, top_n_tokens=2)
        details = response.details
        assert details.finish_reason == "length" and details.generated_tokens == 6 and details.seed is None
        assert [t.id for t in details.tokens] == greedy_reference(server.model_dir, "def add(a, b):", 6)
        assert response.generated_text == "".join(t.text for t in details.tokens)
        assert details.prefill[0].logprob is None and all(t.logprob <= 0 for t in details.prefill[1:])
        assert all(len(top) == 2 and top[0].id == t.id for top, t in zip(details.top_tokens, details.tokens))
        streamed = list(client.generate_stream("def add(a, b):", max_new_tokens=6))
        assert [r.token.id for r in streamed] == [t.id for t in details.tokens]
        assert streamed[-1].generated_text == response.generated_text and streamed[0].generated_text is None
        tokens = client.tokenize("def add(a, b):")
        assert [t.id for t in tokens] == [
            t["id"] for t in httpx.post(f"{server.url}/tokenize", json={"inputs": "def add(a, b):"}).json()
        ]
        info = client.info()
        assert info.model_id == str(server.model_dir) and info.max_total_tokens == 512 and info.engine == "paged"


async def test_async_client_generates_and_streams(server: Server) -> None:
    async with AsyncClient(server.grpc, timeout=60) as client:
        seeded = dict(max_new_tokens=5, do_sample=True, temperature=0.8, seed=9)
        first = await client.generate("x = ", **seeded)
        assert first.details.seed == 9
        assert (await client.generate("x = ", **seeded)).generated_text == first.generated_text
        texts = [r.token.text async for r in client.generate_stream("x = ", **seeded)]
        assert "".join(texts) == first.generated_text
        assert len(await client.tokenize("x = ")) > 1


def kv_free(server: Server) -> bool:
    info = httpx.get(f"{server.url}/info").json()
    return info["kv_blocks_free"] == info["kv_blocks_total"]


def test_leaving_a_stream_early_frees_its_place(server: Server) -> None:
    with Client(server.grpc, timeout=60) as client:
        stream = client.generate_stream("def forever():", max_new_tokens=400, ignore_eos=True)
        received = [next(stream) for _ in range(3)]
        stream.close()  # cancels the call
        assert len(received) == 3
    wait_for(lambda: kv_free(server), 60, "the cancelled request's KV blocks to come back")


async def test_async_stream_cancelled_mid_way(server: Server) -> None:
    async with AsyncClient(server.grpc, timeout=60) as client:
        count = 0
        async for _ in client.generate_stream("def forever():", max_new_tokens=400, ignore_eos=True):
            count += 1
            if count == 3:
                break
    wait_for(lambda: kv_free(server), 60, "the cancelled request's KV blocks to come back")


def test_errors_are_exceptions(server: Server) -> None:
    with Client(server.grpc, timeout=60) as client:
        with pytest.raises(ValidationError, match=r"^`parameters.max_new_tokens` must be at most 511 on this server"):
            client.generate("x", max_new_tokens=100_000)
        with pytest.raises(ValidationError, match=r"^`parameters.temperature`: Input should be greater than 0"):
            list(client.generate_stream("x", temperature=-1.0))
        with pytest.raises(ValidationError, match=r"^`parameters.min_p`: Input should be less than or equal to 1"):
            client.generate("x", min_p=1.5)
        with pytest.raises(ValidationError):
            client.generate("")
    with Client("127.0.0.1:1", timeout=5) as nowhere:
        with pytest.raises(ConnectionError):
            nowhere.generate("x")


def test_min_p_and_top_k_zero(server: Server) -> None:
    """`min_p` is a gRPC parameter; `top_k: 0` is off, so greedy stays greedy."""
    with Client(server.grpc, timeout=60) as client:
        greedy = client.generate("def add(a, b):", max_new_tokens=4, top_k=0)
        assert greedy.details.seed is None
        assert [t.id for t in greedy.details.tokens] == greedy_reference(server.model_dir, "def add(a, b):", 4)
        sampled = dict(max_new_tokens=4, min_p=0.05, seed=3)
        first = client.generate("x = ", **sampled)
        assert first.details.seed == 3  # min_p is a warper: it implies sampling
        assert client.generate("x = ", **sampled).generated_text == first.generated_text


def test_standard_grpc_health_service(server: Server) -> None:
    with grpc.insecure_channel(server.grpc) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "conveyor.v1.TextGeneration"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_structured_output(server: Server) -> None:
    """A constraint over the gRPC front door, sampled (seeded): the text fits it, and ends where it is complete."""
    schema = {
        "type": "object",
        "properties": {"level": {"enum": ["low", "high"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["level", "n"],
    }
    sampled = dict(do_sample=True, temperature=1.0, max_new_tokens=60)
    with Client(server.grpc, timeout=60) as client:
        response = client.generate("def f():", json_schema=schema, seed=5, **sampled)
        jsonschema.validate(json.loads(response.generated_text), schema)
        assert response.details.finish_reason == "eos_token"
        greedy = client.generate("x", json_object=True, max_new_tokens=30)
        assert isinstance(json.loads(greedy.generated_text), dict) and greedy.details.finish_reason == "eos_token"
        assert re.fullmatch(
            r"[0-9]{2}-[ab]", client.generate("x", regex=r"[0-9]{2}-[ab]", seed=2, **sampled).generated_text
        )
        choices = {
            client.generate("x", choice=["red", "green"], seed=seed, **sampled).generated_text for seed in range(3)
        }
        assert choices <= {"red", "green"}
        assert client.generate("x", grammar='start: "a" ("b" | "c")', seed=3, **sampled).generated_text in ("ab", "ac")
        with pytest.raises(ValidationError, match="regex") as error:
            client.generate("x", regex="(unclosed")
        assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ValidationError, match="too many expressions constructed") as error:
            client.generate("x", regex="a{1000000}")  # compiles, but past llguidance's limits at the first token
        assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ValueError, match="at most one constraint"):
            client.generate("x", regex="a", choice=["a"])  # refused by the client before sending
