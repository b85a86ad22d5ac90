"""Embeddings and rerank through the real processes (launcher, router, shards over gRPC), on 1 and 2 shards.

The checkpoint is the tiny random-weight Qwen3 model built offline, made an embedding and reranker checkpoint: the
sentence-transformers files of a mean-pooled, normalized embedder (benchmarks/embedding_model.py), and "yes"
and "no" added to its vocabulary (Qwen3-Reranker scores with their logits; the tiny tokenizer has neither as one
token). One deployment per shard count serves both (`--task embed,rerank`) and generation, for every test here.

References: `SentenceTransformer(...).encode` for the vectors, transformers' causal LM on the model card's prompt
for the scores, transformers' `generate()` for the greedy tokens of a generation read beside them. Tolerance: the
engine's float32 forward against transformers', ATOL on each unit vector's values and on each score.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import Deployments, Server, StreamWatcher, free_port, greedy_reference, start_server, used, wait_for

from benchmarks.embedding_model import write_pooling_files
from conveyor import demo_model
from conveyor.router.pipeline.rerank_prompt import rerank_parts

ATOL = 1e-5
TEXTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello",
    "def add(a, b):\n    return a + b",
    "Embeddings from a decoder, pooled over every token of a prompt that is long enough to be read in chunks",
]
QUERY = "what adds two numbers"
DOCUMENTS = ["def add(a, b): return a + b", "the weather is fine", "yes, no, maybe", "import os"]
# Read in chunks of 16 while a generation decodes beside them: a prompt longer than that takes several steps.
CHUNK_TOKENS = "16"
DEPLOYMENTS = {"one_shard": 1, "two_shards": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 model with sentence-transformers' mean pooling and Normalize, and "yes" and "no" as tokens of
    their own (the embeddings resized to the new vocabulary: 1026, even, so each of two ranks holds half)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("embedding_model")
    source = demo_model.ensure(root / "source", "tiny", seed=5, arch="qwen3")
    out = root / "embed"
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(["yes", "no"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    modes = ("pooling_mode_lasttoken", "pooling_mode_mean_tokens", "pooling_mode_cls_token")
    flags = {mode: mode == "pooling_mode_mean_tokens" for mode in modes}
    return write_pooling_files(out, flags, normalize=True, dimension=model.config.hidden_size)


@pytest.fixture(scope="module")
def deployments(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[Deployments]:
    def start(shards: int) -> Server:
        flags = ["--task", "embed,rerank", "--num-shard", str(shards), "--master-port", str(free_port())]
        return start_server(checkpoint, *flags, "--max-total-tokens", "512", "--prefill-chunk-tokens", CHUNK_TOKENS)

    starts = {name: (lambda shards=shards: start(shards)) for name, shards in DEPLOYMENTS.items()}
    wanted = ["one_shard"] if not used(request, ["served"], module=True) else list(DEPLOYMENTS)
    deployments = Deployments(starts, wanted)
    yield deployments
    assert deployments.stop() == [0] * len(deployments.servers)


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def served(request: pytest.FixtureRequest, deployments: Deployments) -> Server:
    """Each deployment in turn: the tests that take it run on 1 and on 2 shards."""
    return deployments.get(request.param)


@pytest.fixture(scope="module")
def one_shard(deployments: Deployments) -> Server:
    return deployments.get("one_shard")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    """SentenceTransformer's vector of each text, each encoded alone."""
    from sentence_transformers import SentenceTransformer

    encoder = SentenceTransformer(str(checkpoint), device="cpu")
    return {text: torch.from_numpy(encoder.encode([text], batch_size=1)[0]) for text in TEXTS}


def _close(vector: list[float], expected: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(vector), expected, atol=ATOL, rtol=0)


def _post(server: Server, path: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)


def _token_ids(checkpoint: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)(text).input_ids


# --- embeddings --------------------------------------------------------------------------------------------------


def test_embeddings_equal_sentence_transformers_alone_and_batched(
    served: Server, reference: dict[str, torch.Tensor], checkpoint: Path
) -> None:
    """OpenAI's route, a list of inputs and each one alone, as text and as token ids; TEI's `/embed` the same."""
    batched = _post(served, "/v1/embeddings", {"input": TEXTS, "model": "mine"})
    assert batched.status_code == 200, batched.text
    answer = batched.json()
    assert answer["object"] == "list" and answer["model"] == "mine"
    assert [d["index"] for d in answer["data"]] == list(range(len(TEXTS)))
    for data, text in zip(answer["data"], TEXTS):
        _close(data["embedding"], reference[text])
    lengths = [len(_token_ids(checkpoint, t)) for t in TEXTS]
    assert answer["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    alone = _post(served, "/v1/embeddings", {"input": TEXTS[2]}).json()
    _close(alone["data"][0]["embedding"], reference[TEXTS[2]])
    ids = _post(served, "/v1/embeddings", {"input": _token_ids(checkpoint, TEXTS[0])}).json()
    _close(ids["data"][0]["embedding"], reference[TEXTS[0]])
    tei = _post(served, "/embed", {"inputs": TEXTS[:2]})
    assert tei.status_code == 200, tei.text
    for vector, text in zip(tei.json(), TEXTS[:2]):
        _close(vector, reference[text])
    raw = _post(served, "/embed", {"inputs": TEXTS[1], "normalize": False}).json()[0]
    norm = math.sqrt(sum(v * v for v in raw))
    assert abs(norm - 1) > 1e-3  # the mean of the states, not scaled
    _close([v / norm for v in raw], reference[TEXTS[1]])


def test_base64_and_dimensions(one_shard: Server, reference: dict[str, torch.Tensor]) -> None:
    """base64 is the float32 vector's little-endian bytes, as the openai SDK decodes it; `dimensions` keeps the first
    values of the unit vector and scales them back to unit length."""
    text = TEXTS[0]
    floats = _post(one_shard, "/v1/embeddings", {"input": text}).json()["data"][0]["embedding"]
    encoded = _post(one_shard, "/v1/embeddings", {"input": text, "encoding_format": "base64"}).json()
    data = base64.b64decode(encoded["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == floats
    short = _post(one_shard, "/v1/embeddings", {"input": text, "dimensions": 8}).json()["data"][0]["embedding"]
    head = reference[text][:8]
    _close(short, head / head.norm())


def test_the_openai_sdk_embeds(one_shard: Server, reference: dict[str, torch.Tensor]) -> None:
    """The unmodified `openai` SDK asks for base64 and decodes it itself."""
    import openai

    client = openai.OpenAI(base_url=f"{one_shard.url}/v1", api_key="unused")
    answer = client.embeddings.create(input=TEXTS[:2], model="any")
    for data, text in zip(answer.data, TEXTS[:2]):
        _close(data.embedding, reference[text])
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 0


# --- rerank ------------------------------------------------------------------------------------------------------


def _rerank_reference(checkpoint: Path) -> list[tuple[float, float]]:
    """Per document, (P(yes), yes-minus-no logit) at the last position of the model card's prompt: head, pair and
    tail tokenized one by one, no special tokens added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in DOCUMENTS:
        ids = [i for part in rerank_parts(QUERY, document) for i in tokenizer.encode(part, add_special_tokens=False)]
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        pair = torch.stack([last[no], last[yes]])
        scores.append((float(torch.softmax(pair, dim=0)[1]), float(last[yes] - last[no])))
    return scores


def test_rerank_scores_and_order_equal_the_reference(served: Server, checkpoint: Path) -> None:
    expected = _rerank_reference(checkpoint)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i][0])
    tei = _post(served, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert tei.status_code == 200, tei.text
    assert [r["index"] for r in tei.json()] == order
    for rank in tei.json():
        assert rank["score"] == pytest.approx(expected[rank["index"]][0], abs=ATOL)
        assert rank["text"] == DOCUMENTS[rank["index"]]
    raw = _post(served, "/rerank", {"query": QUERY, "texts": DOCUMENTS, "raw_scores": True}).json()
    for rank in raw:
        assert rank["score"] == pytest.approx(expected[rank["index"]][1], abs=10 * ATOL)
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    cohere = _post(served, "/v1/rerank", {"query": QUERY, "documents": documents, "top_n": 2, "model": "r"})
    assert cohere.status_code == 200, cohere.text
    answer = cohere.json()
    assert answer["model"] == "r" and [r["index"] for r in answer["results"]] == order[:2]
    for result in answer["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]][0], abs=ATOL)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert answer["usage"]["total_tokens"] > len(DOCUMENTS) * 40  # the prompt's fixed head and tail included


# --- beside generation, and through the queue ---------------------------------------------------------------------


def _listed(server: Server, request_id: str) -> list[str]:
    rows = httpx.get(f"{server.url}/v1/requests", timeout=10).json()["data"]
    return [row["state"] for row in rows if row["id"] == request_id]


def _idle_and_whole(server: Server) -> bool:
    info = server.info()
    return not httpx.get(f"{server.url}/v1/requests", timeout=10).json()["data"] and (
        info["kv_blocks_free"] == info["kv_blocks_total"]
    )


def test_embeddings_read_beside_a_generation_leave_its_greedy_tokens_unchanged(
    served: Server, reference: dict[str, torch.Tensor], checkpoint: Path
) -> None:
    """The shards are paused while a generation decodes; the embeddings request queues meanwhile, so that the next
    step admits it beside the decoding stream, whose chunk budget then reads the long input in several steps (the
    chunk counter moves only so). The vectors are sentence-transformers', the stream's tokens transformers' greedy
    ones, and once all is done every KV block is free."""
    prompt, new_tokens = "class Queue:\n    def __init__(self):", 300
    generation = StreamWatcher(served, {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}}).start()
    wait_for(lambda: generation.received(2), 120, "the generation to decode")
    chunks = served.metric("conveyor_prefill_chunks_total")
    with ThreadPoolExecutor(1) as pool:
        with served.shards_paused():
            headers = {"X-Request-Id": "beside"}
            answer = pool.submit(_post, served, "/v1/embeddings", {"input": TEXTS}, headers)
            wait_for(lambda: _listed(served, "beside") == ["queued"] * len(TEXTS), 60, "the inputs to queue")
        response = answer.result(timeout=300)
    assert response.status_code == 200, response.text
    for data, text in zip(response.json()["data"], TEXTS):
        _close(data["embedding"], reference[text])
    assert served.metric("conveyor_prefill_chunks_total") > chunks
    generation.last()
    assert generation.token_ids() == greedy_reference(checkpoint, prompt, new_tokens)
    wait_for(lambda: _idle_and_whole(served), 60, "every KV block to be free")


def test_a_queued_embeddings_request_is_cancelled_by_its_id(one_shard: Server) -> None:
    with ThreadPoolExecutor(1) as pool:
        with one_shard.shards_paused():
            answer = pool.submit(_post, one_shard, "/v1/embeddings", {"input": TEXTS[:2]}, {"X-Request-Id": "gone"})
            wait_for(lambda: len(_listed(one_shard, "gone")) == 2, 60, "the inputs to queue")
            assert httpx.delete(f"{one_shard.url}/v1/requests/gone", timeout=10).status_code == 200
            response = answer.result(timeout=60)
    assert response.status_code == 499 and response.json()["error_type"] == "cancelled", response.text
    wait_for(lambda: _idle_and_whole(one_shard), 60, "every KV block to be free")


def test_answers_match_the_openapi_schemas(one_shard: Server) -> None:
    import jsonschema

    document = httpx.get(f"{one_shard.url}/openapi.json", timeout=10).json()
    answers = {
        "EmbeddingList": _post(one_shard, "/v1/embeddings", {"input": ["a", "b"], "encoding_format": "base64"}),
        "Embeddings": _post(one_shard, "/embed", {"inputs": "a"}),
        "TEIRanks": _post(one_shard, "/rerank", {"query": "q", "texts": ["a", "b"], "return_text": True}),
        "RerankList": _post(one_shard, "/v1/rerank", {"query": "q", "documents": ["a"]}),
        "OpenAIError": _post(one_shard, "/v1/rerank", {"query": "q", "documents": []}),
    }
    for name, response in answers.items():
        schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
        jsonschema.validate(response.json(), schema)


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "a", "dimensions": 65}, "at most 64"),
        ("/v1/embeddings", {"input": [5, 99999]}, "outside the vocabulary"),
        ("/v1/embeddings", {"input": "x " * 2000}, "tokens"),
        ("/v1/embeddings", {"input": "a", "temperature": 1}, "temperature"),
        ("/embed", {"inputs": ""}, "inputs"),
        ("/rerank", {"query": "q", "texts": []}, "texts"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ],
)
def test_bad_inputs_are_refused_in_the_routes_shape(one_shard: Server, path: str, body: dict, says: str) -> None:
    response = _post(one_shard, path, body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    message = error["message"] if path.startswith("/v1/") else error
    assert response.json()["error_type"] == "validation" and says in message, response.text


def test_truncate_cuts_an_input_to_the_limit(one_shard: Server) -> None:
    vector = _post(one_shard, "/embed", {"inputs": "x " * 2000, "truncate": True}).json()[0]
    assert len(vector) == 64 and math.isclose(sum(v * v for v in vector), 1.0, abs_tol=1e-5)


def test_a_generation_deployment_refuses_embeddings_and_rerank(server: Server) -> None:
    """The tiny model served as it is (no sentence-transformers files: --task generate) answers 422, saying why."""
    for path, body in (("/v1/embeddings", {"input": "a"}), ("/rerank", {"query": "q", "texts": ["a"]})):
        response = _post(server, path, body)
        assert response.status_code == 422 and "--task" in json.dumps(response.json()), response.text
