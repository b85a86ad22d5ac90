"""What the scheduler sends down a request's stream, independent of the protocol that carries it to the client."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.router.transport.records import Generation, Tokens


@dataclass(frozen=True)
class ScoredToken:
    """One token as a stream carries it: its id, text and log-probability, and whether it is special. A generated
    token, a prompt token (`prefill`) and an alternative (`top_tokens`) alike; the API's own token schema
    (router/api/tgi.py) is what a frontend turns it into."""

    id: int
    text: str
    logprob: float
    special: bool


@dataclass(frozen=True)
class Finished:
    generated_text: str
    finish_reason: str  # length | eos_token | stop_sequence
    generated_tokens: int
    seed: int | None
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified for the request...
    accepted_tokens: int = 0  # ...and accepted
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (memory or disk), not computed


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `finished` is set on the request's last one, `prefill` on its first if asked for."""

    token: ScoredToken
    finished: Finished | None = None
    prefill: tuple[ScoredToken, ...] = ()
    top_tokens: tuple[ScoredToken, ...] = ()  # the most likely alternatives at this step, when asked for


@dataclass(frozen=True)
class PooledEvent:
    """A prompt-only request's one and last event: its pooled vector (embeddings) or its score (rerank: the
    reranker's yes-minus-no logit), and its prompt tokens the prefix cache served."""

    embedding: tuple[float, ...] = ()
    score: float | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class ErrorEvent:
    message: str
    error_type: str = "generation"


Event = TokenEvent | PooledEvent | ErrorEvent


def token_list(tokens: Tokens) -> list[ScoredToken]:
    return [
        ScoredToken(id=i, text=t, logprob=lp, special=s)
        for i, t, lp, s in zip(tokens.ids, tokens.texts, tokens.logprobs, tokens.is_special)
    ]


def events_from_generation(
    generation: Generation, drafted: int = 0, accepted: int = 0, cached: int = 0
) -> list[TokenEvent]:
    """A step's generation becomes one event per token; the last carries `finished` when the request ended, with
    the draft tokens verified and accepted over the request's life and its prompt tokens the prefix cache served."""
    tokens = token_list(generation.tokens)
    prefill = tuple(token_list(generation.prefill_tokens))
    finished = None
    if (f := generation.finished) is not None:
        finished = Finished(
            generated_text=f.text,
            finish_reason=f.finish_reason,
            generated_tokens=f.generated_tokens,
            seed=f.seed,
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            cached_tokens=cached,
        )
    tops = [tuple(token_list(t)) for t in generation.top_tokens]
    events = []
    for n, token in enumerate(tokens):
        last = n == len(tokens) - 1
        top = tops[n] if n < len(tops) else ()
        events.append(TokenEvent(token, finished if last else None, prefill if n == 0 else (), top))
    return events


def pooled_event(generation: Generation, cached: int = 0) -> PooledEvent:
    """A prompt-only request's answer (`generation.pooled`)."""
    return PooledEvent(tuple(generation.embedding), generation.score, cached)
