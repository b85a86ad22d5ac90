"""The pieces of embeddings and rerank that need no deployment: the checkpoint's pooling, the task, the request
shapes, the vectors' wire forms and Qwen3-Reranker's prompt; then the bodies as validated prompt-only requests."""

from __future__ import annotations

import base64
import math
import struct
from pathlib import Path

import pytest
import transformers

from benchmarks.embedding_model import write_pooling_files
from conveyor import demo_model
from conveyor.pooling import PoolingConfigError, PoolingSpec, default_task, read_pooling, resolve_tasks
from conveyor.router.api.base import ValidationError, parse
from conveyor.router.api.embeddings import (
    EmbeddingRequest,
    RerankRequest,
    TEIEmbedRequest,
    TEIRerankRequest,
    embedding_list,
    encode_vector,
    matryoshka,
    ranked,
    rerank_list,
    tei_ranks,
)
from conveyor.router.limits import Limits
from conveyor.router.pipeline.prompt_requests import PromptRequests, TaskError, Tasks
from conveyor.router.pipeline.request import Pooling
from conveyor.router.pipeline.rerank_prompt import rerank_pairs, rerank_parts, rerank_prompt
from conveyor.router.pipeline.validation import Validation


def _sentence_transformers_dir(tmp_path: Path, pooling: dict, normalize: bool) -> Path:
    return write_pooling_files(tmp_path, pooling, normalize, dimension=64)


@pytest.mark.parametrize(
    ("flag", "mode"),
    [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls")],
)
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_is_read_from_the_checkpoint(tmp_path: Path, flag: str, mode: str, normalize: bool) -> None:
    model_dir = _sentence_transformers_dir(tmp_path, {flag: True, "pooling_mode_max_tokens": False}, normalize)
    assert read_pooling(model_dir) == PoolingSpec(mode=mode, normalize=normalize)
    assert default_task(model_dir) == "embed"


def test_unserved_pooling_is_refused(tmp_path: Path) -> None:
    model_dir = _sentence_transformers_dir(tmp_path, {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        read_pooling(model_dir)


def test_a_plain_checkpoint_generates_and_pools_the_last_token(tmp_path: Path) -> None:
    assert default_task(tmp_path) == "generate"
    assert read_pooling(tmp_path) == PoolingSpec(mode="last", normalize=True)
    assert resolve_tasks(None, tmp_path) == ("generate",)
    assert resolve_tasks("rerank", tmp_path) == ("rerank",)
    assert resolve_tasks("rerank, embed", tmp_path) == ("embed", "rerank")
    for wrong in ("classify", "embed,classify", ","):
        with pytest.raises(ValueError, match="--task"):
            resolve_tasks(wrong, tmp_path)


@pytest.mark.parametrize(
    ("value", "inputs"),
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_embedding_inputs_take_every_openai_shape(value: object, inputs: list) -> None:
    assert parse(EmbeddingRequest, {"input": value}).inputs == inputs


@pytest.mark.parametrize(
    "body",
    [
        {"input": []},
        {"input": ""},
        {"input": "a", "encoding_format": "int8"},
        {"input": "a", "dimensions": 0},
        {"input": [-1]},
        {"input": "a", "what": 1},
    ],
)
def test_bad_embedding_requests_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        parse(EmbeddingRequest, body)


def test_matryoshka_renormalizes_only_normalized_vectors() -> None:
    vector = [0.6, 0.0, 0.8]
    assert matryoshka(vector, None, True) == vector
    assert matryoshka(vector, 2, False) == [0.6, 0.0]
    assert matryoshka(vector, 2, True) == pytest.approx([1.0, 0.0])


def test_base64_is_little_endian_float32() -> None:
    encoded = encode_vector([1.5, -2.0], "base64")
    assert isinstance(encoded, str)
    assert struct.unpack("<2f", base64.b64decode(encoded)) == (1.5, -2.0)
    request = parse(EmbeddingRequest, {"input": ["a", "b"], "dimensions": 1})
    answer = embedding_list([[3.0, 4.0], [0.0, 2.0]], request, "m", prompt_tokens=7, normalize=True)
    assert [d["embedding"] for d in answer["data"]] == [[1.0], [0.0]]  # a zero head stays zero
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


def test_rerank_requests_and_order() -> None:
    request = parse(RerankRequest, {"query": "q", "documents": ["a", {"text": "b"}], "top_n": 1})
    assert request.texts == ["a", "b"]
    assert parse(TEIRerankRequest, {"query": "q", "texts": ["a"]}).raw_scores is False
    assert ranked([0.1, 0.9, 0.9, 0.5]) == [(1, 0.9), (2, 0.9), (3, 0.5), (0, 0.1)]
    assert ranked([0.1, 0.9], top_n=1) == [(1, 0.9)]
    assert not math.isnan(ranked([0.0])[0][1])


def test_rerank_prompt_is_qwen3_rerankers_format() -> None:
    prompt = rerank_prompt("what is a cat", "a small feline")
    assert prompt.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert "<Query>: what is a cat\n<Document>: a small feline<|im_end|>\n<|im_start|>assistant\n" in prompt
    assert prompt.endswith("<think>\n\n</think>\n\n")
    assert [p.index for p in rerank_pairs("q", ["x", "y"])] == [0, 1]


def test_rerank_answers_take_teis_and_cohere_shapes() -> None:
    scores = [0.2, 0.7, 0.5]
    tei = parse(TEIRerankRequest, {"query": "q", "texts": ["a", "b", "c"], "return_text": True})
    assert tei_ranks(scores, tei) == [
        {"index": 1, "score": 0.7, "text": "b"},
        {"index": 2, "score": 0.5, "text": "c"},
        {"index": 0, "score": 0.2, "text": "a"},
    ]
    cohere = parse(RerankRequest, {"query": "q", "documents": ["a", "b", "c"], "top_n": 2})
    answer = rerank_list(scores, cohere, "r1", "m", total_tokens=9)
    assert answer["results"] == [
        {"index": 1, "relevance_score": 0.7, "document": {"text": "b"}},
        {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
    ]
    bare = parse(RerankRequest, {"query": "q", "documents": ["a"], "return_documents": False})
    assert rerank_list([0.1], bare, "r2", "m", 1)["results"] == [{"index": 0, "relevance_score": 0.1}]


# --- the deployment's tasks and the bodies as requests -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.ensure(tmp_path_factory.mktemp("tiny"), "tiny")


def _requests(model_dir: Path, tasks: Tasks, max_input_tokens: int = 120, max_inputs: int = 8) -> PromptRequests:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    limits = Limits(max_input_tokens=max_input_tokens, max_total_tokens=max_input_tokens + 1)
    return PromptRequests(Validation(tokenizer, limits), tasks, max_inputs)


def test_tasks_are_read_from_the_flag_and_the_checkpoint(tiny: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    tasks = Tasks.read(None, tiny, tokenizer)
    assert tasks.served == ("generate",) and tasks.dimension == 64
    with pytest.raises(ValidationError, match="--task embed"):
        tasks.require("embed")
    with pytest.raises(TaskError, match="'yes' is not one token"):  # the tiny vocabulary has neither
        Tasks.read("rerank", tiny, tokenizer)
    with pytest.raises(TaskError, match="--task"):
        Tasks.read("classify", tiny, tokenizer)
    assert Tasks.read("embed", tiny, tokenizer).embedding() == Pooling("embed", "last", True)


def test_each_input_is_one_prompt_only_request(tiny: Path) -> None:
    tasks = Tasks(("embed",), PoolingSpec("mean", normalize=False), dimension=64)
    requests = _requests(tiny, tasks, max_inputs=2)
    valids = requests.embeddings(parse(EmbeddingRequest, {"input": ["a b", "c"]}))
    assert [v.pooling for v in valids] == [Pooling("embed", "mean", False)] * 2
    assert all(v.parameters.max_new_tokens == 0 and v.input_ids[0] == 0 for v in valids)  # the tokenizer's BOS
    (given,) = requests.embeddings(parse(EmbeddingRequest, {"input": [5, 6, 7]}))
    assert given.input_ids == (5, 6, 7)
    with pytest.raises(ValidationError, match="at most 2 inputs"):
        requests.embeddings(parse(EmbeddingRequest, {"input": ["a", "b", "c"]}))
    with pytest.raises(ValidationError, match="at most 64"):
        requests.embeddings(parse(EmbeddingRequest, {"input": "a", "dimensions": 65}))
    (tei,) = requests.tei_embed(parse(TEIEmbedRequest, {"inputs": "a", "normalize": True}))
    assert tei.pooling == Pooling("embed", "mean", True)  # the client's choice over the checkpoint's
    (cut,) = requests.tei_embed(parse(TEIEmbedRequest, {"inputs": "x " * 500, "truncate": True}))
    assert len(cut.input_ids) == 120 and cut.input_ids[0] == 0
    with pytest.raises(ValidationError, match="must have less than 120 tokens"):
        requests.tei_embed(parse(TEIEmbedRequest, {"inputs": "x " * 500}))


def test_a_rerank_prompt_is_cut_in_its_pair_keeping_its_head_and_tail(tiny: Path) -> None:
    tasks = Tasks(("rerank",), yes_token_id=7, no_token_id=9)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    head, _, tail = (tokenizer.encode(p, add_special_tokens=False) for p in rerank_parts("q", "d"))
    limit = len(head) + len(tail) + 20
    requests = _requests(tiny, tasks, max_input_tokens=limit)
    body = {"query": "what is it", "texts": ["short", "long " * 200], "truncate": True}
    short, long = requests.rerank(parse(TEIRerankRequest, body))
    assert short.pooling == Pooling("rerank", yes_token_id=7, no_token_id=9)
    assert len(long.input_ids) == limit
    assert list(long.input_ids[: len(head)]) == head and list(long.input_ids[-len(tail) :]) == tail
    with pytest.raises(ValidationError, match="tokens"):
        requests.rerank(parse(RerankRequest, {"query": "q", "documents": ["long " * 200]}))
