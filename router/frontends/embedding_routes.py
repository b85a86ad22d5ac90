"""Embeddings and rerank: OpenAI's `POST /v1/embeddings`, TEI's `POST /embed` and `POST /rerank`, and the
Cohere/Jina `POST /v1/rerank` that vLLM and llama.cpp answer.

Each input of a body is one prompt-only request (router/pipeline/prompt_requests.py): admitted, validated, queued
and stepped as every request is, in the key's fair share, and cancelled with its caller; the shards read its prompt
beside the running batch and answer a vector or a score at the step that reads its end. The inputs of one body are
admitted together or not at all (429), as `n` choices are. A route whose task the deployment was not started with
(`--task`) answers 422 before anything is tokenized. Errors are OpenAI's shape on the `/v1/` routes, Conveyor's on
TEI's (the two TEI routes' own shape is the same: `error` and `error_type`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from conveyor.router.api import embeddings as api
from conveyor.router.api.base import Schema, parse
from conveyor.router.core.events import PooledEvent
from conveyor.router.core.infer import Infer
from conveyor.router.frontends.middleware import caller, request_id
from conveyor.router.frontends.replies import REQUEST_ERRORS, error_response
from conveyor.router.pipeline.prompt_requests import PromptRequests, Tasks
from conveyor.router.pipeline.request import ValidRequest
from conveyor.router.pipeline.validation import Validation


def probability(score: float) -> float:
    """The reranker's P("yes"): the softmax over the yes and no logits, which is the sigmoid of their difference."""
    return 1.0 / (1.0 + math.exp(-score)) if score >= 0 else math.exp(score) / (1.0 + math.exp(score))


class EmbeddingRoutes:
    def __init__(self, infer: Infer, validation: Validation, tasks: Tasks | None, model_id: str) -> None:
        self.infer, self.validation, self.tasks, self.model_id = infer, validation, tasks or Tasks(), model_id

    @functools.cached_property
    def requests(self) -> PromptRequests:
        """The bodies' reader: one body's inputs are at most the requests the server lets be in flight."""
        return PromptRequests(self.validation, self.tasks, self.infer.max_concurrent_requests)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/embed", self.tei_embed)
        app.router.add_post("/rerank", self.tei_rerank)
        app.router.add_post("/v1/rerank", self.rerank)

    async def _answers(
        self,
        request: web.Request,
        task: str,
        schema: type[Schema],
        requests_of: Callable[[Any], list[ValidRequest]],
    ) -> tuple[Any, list[ValidRequest], list[PooledEvent]]:
        """The body, its inputs' requests and their answers in input order. A refused or failed input ends the
        others at once (their blocks are freed at the next step), and a caller that goes away ends them all."""
        self.tasks.require(task)
        key = caller(request)
        self.infer.admit(key, 1)  # refused work costs no tokenizing; the inputs are counted once known

        def read(raw: bytes) -> tuple[Any, list[ValidRequest]]:
            body = parse(schema, raw)
            return body, requests_of(body)

        body, valids = await self.validation.off_loop(read, await request.read(), owner=key.name)
        self.infer.admit(key, len(valids))  # all the inputs or none
        name = request_id(request)
        tasks = [asyncio.ensure_future(self.infer.pool(v, key, name)) for v in valids]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for pending in tasks:
                pending.cancel()
        return body, valids, answers

    async def embeddings(self, request: web.Request) -> web.Response:
        try:
            body, valids, answers = await self._answers(
                request, "embed", api.EmbeddingRequest, self.requests.embeddings
            )
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        vectors = [list(a.embedding) for a in answers]
        normalized = self.tasks.pooling.normalize
        model = body.model or self.model_id
        answer = api.embedding_list(vectors, body, model, _prompt_tokens(valids), normalized)
        return web.json_response(answer)

    async def tei_embed(self, request: web.Request) -> web.Response:
        try:
            _, _, answers = await self._answers(request, "embed", api.TEIEmbedRequest, self.requests.tei_embed)
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        return web.json_response([list(a.embedding) for a in answers])

    async def tei_rerank(self, request: web.Request) -> web.Response:
        try:
            body, _, answers = await self._answers(request, "rerank", api.TEIRerankRequest, self.requests.rerank)
        except REQUEST_ERRORS as exc:
            return error_response(exc)
        scores = [_score(a) if body.raw_scores else probability(_score(a)) for a in answers]
        return web.json_response(api.tei_ranks(scores, body))

    async def rerank(self, request: web.Request) -> web.Response:
        try:
            body, valids, answers = await self._answers(request, "rerank", api.RerankRequest, self.requests.rerank)
        except REQUEST_ERRORS as exc:
            return error_response(exc, openai=True)
        scores = [probability(_score(a)) for a in answers]
        model = body.model or self.model_id
        answer = api.rerank_list(scores, body, f"rerank-{uuid.uuid4().hex}", model, _prompt_tokens(valids))
        return web.json_response(answer)


def _score(answer: PooledEvent) -> float:
    assert answer.score is not None
    return answer.score


def _prompt_tokens(valids: list[ValidRequest]) -> int:
    """Usage: every input's prompt tokens (a reranker's whole prompt, its fixed head and tail included)."""
    return sum(len(v.input_ids) for v in valids)
