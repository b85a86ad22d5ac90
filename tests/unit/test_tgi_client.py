"""Hugging Face's own `text-generation` client, unmodified, against a live deployment."""

from __future__ import annotations

from conftest import Server, greedy_reference
from text_generation import AsyncClient, Client
from text_generation.errors import ValidationError


def test_generate_and_generate_stream(server: Server) -> None:
    client = Client(server.url, timeout=120)
    response = client.generate("def add(a, b):", max_new_tokens=6, decoder_input_details=True)
    assert response.details.finish_reason.value == "length" and response.details.generated_tokens == 6
    assert [t.id for t in response.details.tokens] == greedy_reference(server.model_dir, "def add(a, b):", 6)
    assert response.details.prefill[0].logprob is None
    streamed = list(client.generate_stream("def add(a, b):", max_new_tokens=6))
    assert [r.token.id for r in streamed] == [t.id for t in response.details.tokens]
    assert streamed[-1].generated_text == response.generated_text


async def test_async_client_and_seeded_sampling(server: Server) -> None:
    client = AsyncClient(server.url, timeout=120)
    first = await client.generate("x = ", max_new_tokens=5, do_sample=True, temperature=0.8, seed=5)
    second = await client.generate("x = ", max_new_tokens=5, do_sample=True, temperature=0.8, seed=5)
    assert first.generated_text == second.generated_text and first.details.seed == 5
    tokens = [
        r.token.text
        async for r in client.generate_stream("x = ", max_new_tokens=5, do_sample=True, temperature=0.8, seed=5)
    ]
    assert "".join(tokens) == first.generated_text


def test_validation_errors_raise_the_clients_exception(server: Server) -> None:
    try:
        Client(server.url).generate("x", max_new_tokens=100_000)
    except ValidationError as exc:
        assert "`parameters.max_new_tokens` must be at most 511 on this server (max_total_tokens)" in str(exc)
    else:
        raise AssertionError("a 422 must raise text_generation.errors.ValidationError")
