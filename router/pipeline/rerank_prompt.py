"""Qwen3-Reranker's prompt: a query and a document become one prompt whose next token is "yes" or "no".

The reranker is a causal LM trained on exactly this text, so its score is only meaningful for this format; the
score is then softmax over the "yes" and "no" logits at the last position (computed on the shard).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class RerankPair:
    """One (query, document) pair to score, with the index the answer reports it under."""

    index: int
    query: str
    document: str


def rerank_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The full prompt for one pair, as Qwen3-Reranker's model card formats it."""
    return "".join(rerank_parts(query, document, instruction))


def rerank_parts(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> tuple[str, str, str]:
    """The prompt in the three pieces the model card tokenizes one by one (no special tokens added): the fixed head,
    the pair, which is what truncation shortens (from its end), and the fixed tail."""
    return _PREFIX, f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}", _SUFFIX


def rerank_pairs(query: str, documents: list[str]) -> list[RerankPair]:
    """Every document paired with the query, indexed as the client sent them."""
    return [RerankPair(index=i, query=query, document=doc) for i, doc in enumerate(documents)]
