"""Embeddings and rerank bodies as validated prompt-only requests, one per input: what the deployment serves of them
(`Tasks`: `--task`, the checkpoint's pooling, the reranker's yes/no tokens), and each API's inputs mapped and
validated as every request is (`PromptRequests`).

A route that the deployment's task does not include is refused here, before anything is tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conveyor.pooling import PoolingSpec, read_pooling, resolve_tasks
from conveyor.router.api.base import ValidationError
from conveyor.router.api.embeddings import EmbeddingRequest, RerankRequest, TEIEmbedRequest, TEIRerankRequest
from conveyor.router.pipeline.request import Pooling, ValidRequest, from_embedding_input, from_rerank_pair
from conveyor.router.pipeline.rerank_prompt import rerank_pairs
from conveyor.router.pipeline.validation import Validation

# The routes of each prompt-only task, for the refusal that names them.
ROUTES = {"embed": "/v1/embeddings and /embed", "rerank": "/rerank and /v1/rerank"}
RERANK_TOKENS = ("yes", "no")  # Qwen3-Reranker's answers, whose logits make its score


class TaskError(ValueError):
    """The deployment cannot serve its `--task` (a bad value, a pooling not served, no yes/no tokens): the router
    stops at start with this one line."""


@dataclass(frozen=True)
class Tasks:
    """What the deployment answers beside generation (`served`), and how: the checkpoint's pooling and its vectors'
    length for embeddings, the vocabulary's "yes" and "no" for rerank."""

    served: tuple[str, ...] = ("generate",)
    pooling: PoolingSpec = PoolingSpec()
    dimension: int = 0
    yes_token_id: int = 0
    no_token_id: int = 0

    @classmethod
    def read(cls, flag: str | None, model_dir: str | Path, tokenizer: Any) -> Tasks:
        model_dir = Path(model_dir)
        try:
            served = resolve_tasks(flag, model_dir)
            pooling = read_pooling(model_dir) if "embed" in served else PoolingSpec()
        except ValueError as exc:  # PoolingConfigError is one
            raise TaskError(str(exc)) from None
        yes = no = 0
        if "rerank" in served:
            yes, no = (_single_token(tokenizer, text) for text in RERANK_TOKENS)
        return cls(served, pooling, _hidden_size(model_dir), yes, no)

    def require(self, task: str) -> None:
        """Refuses (422) a request of a task this deployment does not serve, naming what it serves."""
        if task not in self.served:
            raise ValidationError(
                f"this deployment does not serve {ROUTES[task]}: it was started with --task {','.join(self.served)} "
                f"(start it with --task {task}, or add {task} to the list)"
            )

    def embedding(self, normalize: bool | None = None) -> Pooling:
        """An embedding's pooling: the checkpoint's, with its normalization unless the client chose."""
        spec = self.pooling
        return Pooling("embed", spec.mode, spec.normalize if normalize is None else normalize)

    def score(self) -> Pooling:
        return Pooling("rerank", yes_token_id=self.yes_token_id, no_token_id=self.no_token_id)


def _single_token(tokenizer: Any, text: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(text)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise TaskError(
            f"--task rerank scores with the logits of {' and '.join(map(repr, RERANK_TOKENS))} (Qwen3-Reranker's), "
            f"but {text!r} is not one token of this tokenizer"
        )
    return int(token_id)


def _hidden_size(model_dir: Path) -> int:
    """The vectors' length: config.json's hidden size (an image-text checkpoint's text model's)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size") or 0)


class PromptRequests:
    """Reads embeddings and rerank bodies against the server's validation; `max_inputs` is the most inputs one body
    may carry (each is a request in flight: more than --max-concurrent-requests could never all be admitted)."""

    def __init__(self, validation: Validation, tasks: Tasks, max_inputs: int) -> None:
        self.validation, self.tasks, self.max_inputs = validation, tasks, max_inputs

    @property
    def truncate_to(self) -> int:
        return self.validation.limits.max_input_tokens

    def _count(self, inputs: int) -> None:
        if inputs > self.max_inputs:
            raise ValidationError(
                f"at most {self.max_inputs} inputs per request on this server (--max-concurrent-requests). Given: "
                f"{inputs}"
            )

    def embeddings(self, body: EmbeddingRequest) -> list[ValidRequest]:
        """OpenAI's: each input a request; `dimensions` may not ask for more than the model's vectors hold."""
        inputs = body.inputs
        self._count(len(inputs))
        if body.dimensions is not None and self.tasks.dimension and body.dimensions > self.tasks.dimension:
            raise ValidationError(f"`dimensions` must be at most {self.tasks.dimension}. Given: {body.dimensions}")
        pooling = self.tasks.embedding()
        return [self.validation.validate(from_embedding_input(i, pooling, None, body.model)) for i in inputs]

    def tei_embed(self, body: TEIEmbedRequest) -> list[ValidRequest]:
        """TEI's: `normalize` when the body sets it (else the checkpoint's), `truncate` to the input limit."""
        self._count(len(body.texts))
        pooling = self.tasks.embedding(body.normalize if "normalize" in body.model_fields_set else None)
        truncate = self.truncate_to if body.truncate else None
        return [self.validation.validate(from_embedding_input(t, pooling, truncate, None)) for t in body.texts]

    def rerank(self, body: TEIRerankRequest | RerankRequest) -> list[ValidRequest]:
        """Every text paired with the query, each pair a request in the client's order."""
        texts = body.texts
        self._count(len(texts))
        truncate = self.truncate_to if getattr(body, "truncate", False) else None
        model = getattr(body, "model", None)
        pooling = self.tasks.score()
        return [
            self.validation.validate(from_rerank_pair(pair, pooling, truncate, model))
            for pair in rerank_pairs(body.query, texts)
        ]
