"""The embedding and rerank APIs' request and answer types: OpenAI's `/v1/embeddings`, TEI's `/embed` and `/rerank`,
and the Cohere/Jina `/v1/rerank` that vLLM and llama.cpp answer.

They are one module because all four carry the same thing (prompts in, one vector or one score per prompt out);
the vector's wire forms (Matryoshka truncation, base64 float32) live here too, since only these answers use them.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Annotated, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from conveyor.router.api.base import Schema, Text

MAX_INPUTS = 2048  # OpenAI's own limit on inputs per embeddings request
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(Schema):
    """OpenAI's embeddings request: a string, a list of strings, a token-id list or a list of them."""

    input: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    model: str = None  # type: ignore[assignment]
    user: str = None  # type: ignore[assignment]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[
        int, Field(ge=1, description="Matryoshka truncation; renormalized when the model normalizes")
    ] = None  # type: ignore[assignment]

    @property
    def inputs(self) -> list[str | list[int]]:
        """One entry per vector answered: text to tokenize, or token ids taken as they are."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [list(value)]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


class TEIEmbedRequest(Schema):
    """TEI's `/embed`: `normalize` defaults to the checkpoint's; `truncate` cuts an over-long input to the limit."""

    inputs: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    normalize: bool = True
    truncate: bool = False

    @property
    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class TEIRerankRequest(Schema):
    """TEI's `/rerank`: scores are probabilities unless `raw_scores` asks for the yes-minus-no logit."""

    query: Text
    texts: Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    return_text: bool = False
    raw_scores: bool = False
    truncate: bool = False


class RerankRequest(Schema):
    """The Cohere/Jina shape: `top_n` keeps the best; `documents` are strings or `{"text": ...}`."""

    query: Text
    documents: Annotated[list[Text | dict[str, Text]], Field(min_length=1, max_length=MAX_INPUTS)]
    model: str = None  # type: ignore[assignment]
    top_n: Annotated[int, Field(ge=1)] = None  # type: ignore[assignment]
    return_documents: bool = True

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.get("text", "") for d in self.documents]


class EmbeddingData(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(TypedDict):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def matryoshka(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The first `dimensions` values, renormalized when the model's vectors are unit length: a truncated unit
    vector is no longer one, and a client comparing by dot product expects it to be."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(sum(v * v for v in head)) or 1.0
    return [v / norm for v in head]


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's base64 form is the little-endian float32 bytes, which the SDK decodes with numpy's frombuffer."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_list(
    vectors: list[list[float]], request: EmbeddingRequest, model: str, prompt_tokens: int, normalize: bool
) -> EmbeddingList:
    """OpenAI's answer for `vectors`, in input order."""
    data: list[EmbeddingData] = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_vector(matryoshka(v, request.dimensions, normalize), request.encoding_format),
        }
        for i, v in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def ranked(scores: list[float], top_n: int | None = None) -> list[tuple[int, float]]:
    """(index, score) best first; ties keep the client's order so the answer is deterministic."""
    order = sorted(enumerate(scores), key=lambda item: (-item[1], item[0]))
    return order if top_n is None else order[:top_n]


class TEIRank(TypedDict):
    index: int
    score: float
    text: NotRequired[str]


class RerankDocument(TypedDict):
    text: str


class RerankResult(TypedDict):
    index: int
    relevance_score: float
    document: NotRequired[RerankDocument]


class RerankUsage(TypedDict):
    total_tokens: int


class RerankList(TypedDict):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


def tei_ranks(scores: list[float], request: TEIRerankRequest) -> list[TEIRank]:
    """TEI's `/rerank` answer: every text, best first, with its text when `return_text` asks."""
    ranks: list[TEIRank] = []
    for index, score in ranked(scores):
        rank: TEIRank = {"index": index, "score": score}
        if request.return_text:
            rank["text"] = request.texts[index]
        ranks.append(rank)
    return ranks


def rerank_list(
    scores: list[float], request: RerankRequest, request_id: str, model: str, total_tokens: int
) -> RerankList:
    """The Cohere/Jina answer: the `top_n` best, each with its document unless `return_documents` is false."""
    texts = request.texts
    results: list[RerankResult] = []
    for index, score in ranked(scores, request.top_n):
        result: RerankResult = {"index": index, "relevance_score": score}
        if request.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return {"id": request_id, "model": model, "results": results, "usage": {"total_tokens": total_tokens}}
