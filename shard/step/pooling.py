"""A prompt's hidden states made into its embedding, and a reranker's yes/no logits made into its score.

Embedding and rerank requests are prompt-only: the prefill's last-layer states (or its last logits) are all they
need, so the engine hands each such row's slice here instead of sampling a token: which positions' final states a
row keeps at a step (`state_spans`), and the vector or score it answers once its prompt is read (`answers`).
"""

from __future__ import annotations

import torch

from conveyor.pooling import PoolingSpec
from conveyor.shard.batch.prompt_pooling import PoolingError, PromptPooling
from conveyor.shard.batch.request_state import RequestState
from conveyor.v1 import shard_pb2 as pb


def pool(hidden: torch.Tensor, spec: PoolingSpec) -> torch.Tensor:
    """One prompt's vector from its final-norm hidden states [T, H], in float32 as sentence-transformers gives it.

    `last` takes the final position (the only one that has seen the whole prompt in a causal model), `mean`
    averages all, `cls` takes the first; normalization is the checkpoint's Normalize module (L2, as torch's
    `normalize` computes it, so a zero vector stays zero rather than becoming NaN).
    """
    states = hidden.float()
    if spec.mode == "last":
        vector = states[-1]
    elif spec.mode == "mean":
        vector = states.mean(dim=0)
    elif spec.mode == "cls":
        vector = states[0]
    else:
        raise ValueError(f"unknown pooling mode {spec.mode!r}")
    return _normalized(vector) if spec.normalize else vector


def _normalized(vector: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(vector, p=2.0, dim=0)


def pooled(pooling: PromptPooling, prompt_len: int) -> torch.Tensor:
    """A request's vector once its whole prompt was read chunk by chunk (`pool` of its states, from what each chunk
    kept): sentence-transformers' mean is the sum over the count, as here."""
    if pooling.total is None:
        raise PoolingError("no hidden states were kept for this prompt")
    vector = pooling.total / prompt_len if pooling.mode == "mean" else pooling.total
    return _normalized(vector) if pooling.normalize else vector


def pool_rows(hidden: torch.Tensor, lengths: list[int], spec: PoolingSpec) -> list[torch.Tensor]:
    """Each prompt's vector from a flat forward's states [sum(lengths), H], rows in order."""
    return [pool(rows, spec) for rows in torch.split(hidden, lengths)]


def yes_no_score(logits: torch.Tensor, yes_id: int, no_id: int, raw: bool = False) -> float:
    """Qwen3-Reranker's relevance: P("yes") of the softmax over just the "yes" and "no" logits at the last position.
    `raw` gives the logit difference instead (TEI's `raw_scores`), whose sigmoid is that probability."""
    pair = logits.float()[[no_id, yes_id]]
    if raw:
        return float(pair[1] - pair[0])
    return float(torch.softmax(pair, dim=0)[1])


def state_spans(
    rows: list[RequestState], new_tokens: list[list[int]], ending: list[RequestState]
) -> list[tuple[int, int]]:
    """Per row, (first, count): the positions of its tokens whose final hidden states the forward keeps (a
    prompt-only row's, as its pooling needs them; none of any other row)."""
    ends = {id(r) for r in ending}
    return [
        (0, 0)
        if state.pooling is None
        else state.pooling.span(state.num_computed_tokens, len(tokens), id(state) in ends)
        for state, tokens in zip(rows, new_tokens)
    ]


def answers(
    pooling: list[RequestState],
    spans: list[tuple[int, int]],
    states: torch.Tensor,
    done: list[RequestState],
    logits: torch.Tensor,
) -> list[pb.Generation]:
    """Prompt-only rows take the final states their chunk kept; those whose prompt ended (`done`) answer their
    vector or score (the scores' logits are the step's last rows) and finish, with no token."""
    for state, kept in zip(pooling, torch.split(states, [count for _, count in spans])):
        state.pooling.take(kept)
    scores = iter(logits[len(logits) - sum(s.pooling.scores for s in done) :])
    generations = []
    for state in done:
        generation = pb.Generation(
            request_id=state.id, disk_cached_tokens=state.disk_cached_tokens, finished=pb.GeneratedText()
        )
        p = state.pooling
        if p.scores:
            generation.score = yes_no_score(next(scores), p.yes_token_id, p.no_token_id, raw=True)
        else:
            generation.embedding.extend(pooled(p, len(state.input_ids)).tolist())
        generations.append(generation)
    return generations
